//! Reasoning apart from the answer: models whose chat template opens a thinking block (Qwen3's
//! and DeepSeek-R1's `<think>` … `</think>`) write their reasoning before the answer. This module
//! tells where a generated text's reasoning ends ([`Reasoning::split`], [`Reasoning::visible`]),
//! and wraps a request's constraint (structured output, forced tool calls) so that it applies to
//! the answer after the reasoning, not to the reasoning ([`Reasoning::constrain`]).
//!
//! Whether an answer starts inside the block is read from the template itself: a probe
//! conversation is rendered with the generation prompt, and a prompt that ends with an open
//! `<think>` (DeepSeek-R1's newer templates, or any template forcing thoughts) puts the answer
//! inside; one that ends with a closed block (Qwen3 with `enable_thinking` false) has no
//! reasoning; otherwise the model may open the block itself as its first words.

use crate::grammar::Constraint;
use crate::tokenizer::{ChatMessage, Tokenizer};

/// The tag that opens a thinking block.
pub const THINK_OPEN: &str = "<think>";
/// The tag that closes it.
pub const THINK_CLOSE: &str = "</think>";

/// Where a model's answer starts relative to its thinking block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reasoning {
    /// The prompt opened the block: the answer starts as reasoning, until `</think>`.
    Inside,
    /// The answer may open the block as its first words (after whitespace).
    MayOpen,
}

impl Reasoning {
    /// Whether the model's template thinks, and where its answer starts, given the request's
    /// `enable_thinking` (the template's switch; `None` leaves its default). `None` when the
    /// template has no thinking block, or the switch turned it off.
    pub fn of(tok: &Tokenizer, enable_thinking: Option<bool>) -> Option<Reasoning> {
        let src = tok.chat_template_source()?;
        if !src.contains(THINK_OPEN) {
            return None;
        }
        let probe = [ChatMessage::new("user", "Hello")];
        let rendered = tok.apply_chat_template_full(&probe, None, true, enable_thinking).ok()?;
        let tail = rendered.trim_end();
        if tail.ends_with(THINK_OPEN) {
            Some(Reasoning::Inside)
        } else if tail.ends_with(THINK_CLOSE) {
            None
        } else {
            Some(Reasoning::MayOpen)
        }
    }

    /// Where the reasoning's text starts in `text`, when it has started: 0 inside; after the
    /// opening tag when the model wrote it first. `None` while `text` may still be opening it,
    /// or when it did not.
    fn body_start(self, text: &str) -> Result<usize, bool> {
        match self {
            Reasoning::Inside => Ok(0),
            Reasoning::MayOpen => {
                let t = text.trim_start();
                if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                    Ok(text.len() - rest.len())
                } else {
                    // Still undecided (`true`) while the text may become the tag.
                    Err(THINK_OPEN.starts_with(t))
                }
            }
        }
    }

    /// A finished answer's reasoning (`None` when it has none) and the answer after it, leading
    /// whitespace removed. An answer cut short inside the block is all reasoning.
    pub fn split(self, text: &str) -> (Option<&str>, &str) {
        let start = match self.body_start(text) {
            Ok(s) => s,
            Err(_) => return (None, text),
        };
        let body = &text[start..];
        match body.find(THINK_CLOSE) {
            Some(end) => (Some(&body[..end]), body[end + THINK_CLOSE.len()..].trim_start()),
            None => (Some(body), ""),
        }
    }

    /// What a streamed answer may show so far: the reasoning's visible part (a prefix of what
    /// [`Reasoning::split`] gives for any continuation) and, once the block has closed or was
    /// never opened, the answer's. A tag cut by the end of the text waits.
    pub fn visible(self, text: &str) -> (&str, Option<&str>) {
        let start = match self.body_start(text) {
            Ok(s) => s,
            Err(true) => return ("", None),
            Err(false) => return ("", Some(text)),
        };
        let body = &text[start..];
        match body.find(THINK_CLOSE) {
            Some(end) => (&body[..end], Some(body[end + THINK_CLOSE.len()..].trim_start())),
            None => {
                // Hold back what may be the start of the closing tag.
                let mut keep = body.len();
                for (i, _) in body.char_indices().rev().take(THINK_CLOSE.len()) {
                    if THINK_CLOSE.starts_with(&body[i..]) {
                        keep = i;
                    }
                }
                (&body[..keep], None)
            }
        }
    }

    /// `c` applied to the answer after the reasoning: free text up to `</think>` (after
    /// `<think>` when the model must open it), optional whitespace, then `c`'s language. `None`
    /// constrains only the shape (reasoning, then anything).
    pub fn constrain(self, c: &Constraint, tok: &Tokenizer) -> Result<Constraint, String> {
        let inner = match c {
            Constraint::JsonObject => {
                format!("start: %json {}", json_layout(serde_json::json!({"type": "object"})))
            }
            Constraint::JsonSchema(s) => {
                let v: serde_json::Value =
                    serde_json::from_str(s).map_err(|e| format!("the schema is not JSON: {e}"))?;
                let v = if v == serde_json::Value::Bool(true) { serde_json::json!({}) } else { v };
                format!("start: %json {}", json_layout(v))
            }
            Constraint::Regex(r) => format!("start: /{}/", escape_slashes(r)),
            Constraint::Choice(options) => {
                let alts: Vec<String> =
                    options.iter().map(|o| serde_json::Value::from(o.as_str()).to_string()).collect();
                format!("start: {}", alts.join(" | "))
            }
            Constraint::Grammar(g) => g.clone(),
        };
        let tag = |t: &str| match tok.token_to_id(t) {
            Some(id) if tok.is_special(id) => format!("<[{id}]>"),
            _ => serde_json::Value::from(t).to_string(),
        };
        let start = match self {
            Reasoning::Inside => "start: thought GAP answer".to_owned(),
            // The model may answer without thinking.
            Reasoning::MayOpen => format!("start: ({} thought GAP)? answer", tag(THINK_OPEN)),
        };
        let close = tag(THINK_CLOSE);
        Ok(Constraint::Grammar(format!(
            "{start}\nthought[lazy]: /(.|\\n)*/ {close}\nGAP: /[ \\t\\r\\n]*/\nanswer: %lark {{\n{inner}\n}}\n"
        )))
    }
}

/// `r` with every `/` that is not already escaped escaped, for a Lark regex literal.
fn escape_slashes(r: &str) -> String {
    let mut out = String::with_capacity(r.len());
    let mut escaped = false;
    for c in r.chars() {
        if c == '/' && !escaped {
            out.push('\\');
        }
        escaped = c == '\\' && !escaped;
        out.push(c);
    }
    out
}

/// A schema with the crate's compact JSON layout, as the structured-output path writes it.
fn json_layout(mut v: serde_json::Value) -> serde_json::Value {
    if let serde_json::Value::Object(o) = &mut v {
        o.entry("x-guidance").or_insert_with(
            || serde_json::json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false}),
        );
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_answer_splits_at_the_closing_tag() {
        let r = Reasoning::Inside;
        assert_eq!(r.split("plan it\n</think>\n\nThe answer."), (Some("plan it\n"), "The answer."));
        assert_eq!(r.split("still thinking"), (Some("still thinking"), ""), "cut short inside");
        let m = Reasoning::MayOpen;
        assert_eq!(m.split("<think>\nhm\n</think>\nYes"), (Some("\nhm\n"), "Yes"));
        assert_eq!(m.split("  <think>a</think>b"), (Some("a"), "b"));
        assert_eq!(m.split("Just an answer"), (None, "Just an answer"));
        assert_eq!(m.split("<thin"), (None, "<thin"));
    }

    #[test]
    fn streaming_shows_only_what_a_continuation_keeps() {
        let r = Reasoning::Inside;
        assert_eq!(r.visible("abc</th"), ("abc", None), "a cut closing tag waits");
        assert_eq!(r.visible("abc<"), ("abc", None));
        assert_eq!(r.visible("a < b"), ("a < b", None));
        assert_eq!(r.visible("abc</think>\n"), ("abc", Some("")));
        assert_eq!(r.visible("abc</think>\nHi"), ("abc", Some("Hi")));
        let m = Reasoning::MayOpen;
        assert_eq!(m.visible("<thi"), ("", None), "may still open the block");
        assert_eq!(m.visible(""), ("", None));
        assert_eq!(m.visible("Hello"), ("", Some("Hello")));
        assert_eq!(m.visible("<think>x"), ("x", None));
        // Every prefix's visible parts are prefixes of the whole's split.
        let whole = "<think>\nstep 1 < step 2\n</think>\n\nDone.";
        let (reasoning, answer) = m.split(whole);
        for cut in 0..=whole.len() {
            let (r, a) = m.visible(&whole[..cut]);
            assert!(reasoning.unwrap().starts_with(r), "{cut}: {r:?}");
            if let Some(a) = a {
                assert!(answer.starts_with(a), "{cut}: {a:?}");
            }
        }
    }
}
