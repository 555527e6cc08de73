//! Reasoning on a real tokenizer with thinking templates: where an answer starts (the template's
//! generation prompt, and its `enable_thinking` switch), and constraints that apply to the answer
//! after the reasoning, checked token by token by the constraint engine.

use std::path::PathBuf;

use tandem_model::grammar::Constraint;
use tandem_model::reasoning::Reasoning;
use tandem_model::tokenizer::Tokenizer;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference")
}

/// The llama-gqa fixture's tokenizer with `template` as its chat template.
fn tokenizer_with(template: &str) -> Tokenizer {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("tandem-reasoning-{}-{n}-{template}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(root().join("fixtures/llama-gqa").join(f), dir.join(f)).unwrap();
    }
    std::fs::copy(root().join("templates").join(template), dir.join("chat_template.jinja")).unwrap();
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    tok
}

#[test]
fn the_template_tells_where_the_answer_starts() {
    let qwen = tokenizer_with("think-qwen3.jinja");
    assert_eq!(Reasoning::of(&qwen, None), Some(Reasoning::MayOpen));
    assert_eq!(Reasoning::of(&qwen, Some(true)), Some(Reasoning::MayOpen));
    assert_eq!(Reasoning::of(&qwen, Some(false)), None, "the switch closes the block in the prompt");
    let open = tokenizer_with("think-open.jinja");
    assert_eq!(Reasoning::of(&open, None), Some(Reasoning::Inside));
    let plain = Tokenizer::from_hf_dir(&root().join("fixtures/llama-gqa")).unwrap();
    assert_eq!(Reasoning::of(&plain, None), None, "a template without a thinking block");
}

/// Whether the constraint accepts `text` whole (every token allowed, then complete).
fn accepts(tok: &Tokenizer, c: &Constraint, text: &str) -> bool {
    let mut g = tok.grammar().unwrap().compile(c).unwrap();
    let ids = tok.encode(text, false).unwrap();
    for &t in &ids {
        if !g.allows_next(t).unwrap() {
            return false;
        }
        g.advance(t).unwrap();
    }
    g.is_complete()
}

#[test]
fn constraints_apply_to_the_answer_after_the_reasoning() {
    let schema = Constraint::JsonSchema(
        r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}"#
            .into(),
    );
    let qwen = tokenizer_with("think-qwen3.jinja");
    let c = Reasoning::MayOpen.constrain(&schema, &qwen).unwrap();
    assert!(accepts(&qwen, &c, "<think>\n2 + 2 {is} \"4\"\n</think>\n\n{\"n\": 4}"));
    assert!(accepts(&qwen, &c, "{\"n\": 4}"), "an answer without thoughts");
    assert!(!accepts(&qwen, &c, "<think>x</think> {\"n\": \"four\"}"), "the answer obeys the schema");
    assert!(!accepts(&qwen, &c, "<think>x</think> {\"n\": 4} more"));
    assert!(!accepts(&qwen, &c, "<think>unfinished"));
    let open = tokenizer_with("think-open.jinja");
    let c = Reasoning::Inside.constrain(&schema, &open).unwrap();
    assert!(accepts(&open, &c, "any {thoughts}</think>{\"n\": 1}"));
    assert!(!accepts(&open, &c, "{\"n\": 1}"), "inside the block, the answer comes after it closes");
    // Every kind of constraint wraps.
    let kinds = [
        (Constraint::JsonObject, "{\"a\": 1}", "[1]"),
        (Constraint::Regex("[0-9]+/[0-9]+".into()), "3/4", "3"),
        (Constraint::Regex("https?:\\/\\/x".into()), "https://x", "http:x"),
        (Constraint::Choice(vec!["yes".into(), "no \"way\"".into()]), "no \"way\"", "maybe"),
        (Constraint::Grammar("start: \"a\" \"b\"+".into()), "abb", "ba"),
    ];
    for (c, good, bad) in kinds {
        let w = Reasoning::MayOpen.constrain(&c, &qwen).unwrap();
        assert!(accepts(&qwen, &w, &format!("<think>hm</think>\n{good}")), "{c:?}");
        assert!(!accepts(&qwen, &w, &format!("<think>hm</think>\n{bad}")), "{c:?}");
    }
}
