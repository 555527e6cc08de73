//! One choice's answer read out of the router's text stream: its reasoning, its content and its
//! tool calls ([`AnswerReader`]), as every chat API needs them. Streaming shows reasoning and
//! content as soon as a continuation cannot take them back; calls come whole, once the answer
//! is finished.

use tandem_model::tokenizer::Tokenizer;
use tandem_model::tools::{ParsedCall, ToolFormat};
use tandem_proto::v1::GenerateResponse;

use super::chat::OutputPlan;

/// A part of a streamed answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Text(String),
}

/// A finished answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    pub reasoning: Option<String>,
    /// `None` when there is no text but whitespace (beside calls) or no text at all.
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

/// Reads one choice's answer.
pub struct AnswerReader {
    plan: OutputPlan,
    tok: Tokenizer,
    /// The answer's text, with the special token that opens calls (Mistral's `[TOOL_CALLS]`),
    /// which the router's text leaves out, put back where it was generated.
    raw: String,
    /// That token's id, when calls are read and the vocabulary has it as a special token.
    marker: Option<u32>,
    /// Bytes of reasoning and of content already shown.
    sent_reasoning: usize,
    sent_text: usize,
}

const MISTRAL_MARK: &str = "[TOOL_CALLS]";

impl AnswerReader {
    pub fn new(plan: OutputPlan, tok: Tokenizer) -> AnswerReader {
        let marker =
            plan.tools.as_ref().and_then(|_| tok.token_to_id(MISTRAL_MARK)).filter(|&id| tok.is_special(id));
        AnswerReader { plan, tok, raw: String::new(), marker, sent_reasoning: 0, sent_text: 0 }
    }

    /// The whole text so far, as the formats read it.
    pub fn text(&self) -> &str {
        &self.raw
    }

    /// Takes in one response's text, showing nothing (an answer given at once).
    pub fn append(&mut self, r: &GenerateResponse) {
        let Some(mark) = self.marker.filter(|m| r.token_ids.contains(m)) else {
            self.raw.push_str(&r.text);
            return;
        };
        // Put the marker back at its token: after the text of the tokens before it.
        let mut at = 0;
        let mut start = 0;
        for (k, _) in r.token_ids.iter().enumerate().filter(|(_, &t)| t == mark) {
            let before = self.tok.decode(&r.token_ids[start..k], true).unwrap_or_default();
            let mut end = (at + before.len()).min(r.text.len());
            while !r.text.is_char_boundary(end) {
                end -= 1;
            }
            self.raw.push_str(&r.text[at..end]);
            self.raw.push_str(MISTRAL_MARK);
            (at, start) = (end, k + 1);
        }
        self.raw.push_str(&r.text[at..]);
    }

    /// Takes in one response's text; gives what may be shown now.
    pub fn push(&mut self, r: &GenerateResponse) -> Vec<Piece> {
        self.append(r);
        let text = self.raw.as_str();
        let (reasoning, answer) = match self.plan.reasoning {
            Some(r) => r.visible(text),
            None => ("", Some(text)),
        };
        let content = match (answer, &self.plan.tools) {
            (None, _) => String::new(),
            (Some(a), None) => a.to_owned(),
            (Some(a), Some(t)) => t.format.visible(a).into_owned(),
        };
        let mut out = Vec::new();
        if let Some(part) = reasoning.get(self.sent_reasoning..).filter(|p| !p.is_empty()) {
            out.push(Piece::Reasoning(part.to_owned()));
            self.sent_reasoning = reasoning.len();
        }
        if let Some(part) = content.get(self.sent_text..).filter(|p| !p.is_empty()) {
            out.push(Piece::Text(part.to_owned()));
            self.sent_text = content.len();
        }
        out
    }

    /// The finished answer.
    pub fn answer(&self) -> Answer {
        let text = self.raw.as_str();
        let (reasoning, rest) = match self.plan.reasoning {
            Some(r) => r.split(text),
            None => (None, text),
        };
        let (content, calls) = match &self.plan.tools {
            Some(t) => {
                let p = t.format.parse(rest, &t.names);
                (p.content, p.calls)
            }
            None => ((!rest.is_empty()).then(|| rest.to_owned()), Vec::new()),
        };
        Answer { reasoning: reasoning.map(str::to_owned), content, calls }
    }

    /// Once the last response was pushed: what is left to show, and the calls.
    pub fn finish(&mut self) -> (Vec<Piece>, Vec<ParsedCall>) {
        let a = self.answer();
        let mut out = Vec::new();
        if let Some(part) = a.reasoning.as_deref().and_then(|r| r.get(self.sent_reasoning..)) {
            if !part.is_empty() {
                out.push(Piece::Reasoning(part.to_owned()));
            }
        }
        // Content shown while streaming is a prefix of the final content (see `visible`).
        if let Some(part) = a.content.as_deref().and_then(|c| c.get(self.sent_text..)) {
            if !part.is_empty() {
                out.push(Piece::Text(part.to_owned()));
            }
        }
        self.sent_reasoning = a.reasoning.as_ref().map_or(0, String::len);
        self.sent_text = a.content.as_ref().map_or(self.sent_text, String::len);
        (out, a.calls)
    }

    /// The tool-call format, when calls are read.
    pub fn format(&self) -> Option<ToolFormat> {
        self.plan.tools.as_ref().map(|t| t.format)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::chat::ToolParse;
    use tandem_model::reasoning::Reasoning;

    /// The fixture's tokenizer with Mistral's `[TOOL_CALLS]` added as a special token.
    fn mistral_marked() -> (Tokenizer, u32) {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference");
        let dir = std::env::temp_dir().join(format!("tandem-answer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["tokenizer_config.json", "generation_config.json"] {
            std::fs::copy(root.join("fixtures/llama-gqa").join(f), dir.join(f)).unwrap();
        }
        let mut t: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root.join("fixtures/llama-gqa/tokenizer.json")).unwrap(),
        )
        .unwrap();
        let id = t["model"]["vocab"].as_object().unwrap().len() as u32;
        t["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({"id": id, "content": MISTRAL_MARK,
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
        std::fs::write(dir.join("tokenizer.json"), t.to_string()).unwrap();
        std::fs::copy(root.join("templates/tools-mistral.jinja"), dir.join("chat_template.jinja")).unwrap();
        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(tok.token_to_id(MISTRAL_MARK), Some(id));
        (tok, id)
    }

    fn response(tok: &Tokenizer, ids: Vec<u32>) -> GenerateResponse {
        let text = tok.decode(&ids, true).unwrap();
        GenerateResponse { text, token_ids: ids, ..Default::default() }
    }

    /// The special token that opens Mistral's calls is put back where it was generated, after
    /// reasoning or text too, so the calls are read (the router's text leaves it out).
    #[test]
    fn a_call_marker_after_reasoning_is_read() {
        let (tok, mark) = mistral_marked();
        let plan = OutputPlan {
            tools: Some(ToolParse { format: ToolFormat::Mistral, names: vec!["add".into()] }),
            reasoning: Some(Reasoning::MayOpen),
        };
        let enc = |s: &str| tok.encode(s, false).unwrap();
        let mut r = AnswerReader::new(plan.clone(), tok.clone());
        let mut ids = enc("<think>sum</think> ");
        ids.push(mark);
        ids.extend(enc("[{\"name\": \"add\", \"arguments\": {\"a\": 1}}]"));
        // One token per response, and all in one response: the same answer.
        for t in &ids {
            r.push(&response(&tok, vec![*t]));
        }
        let mut whole = AnswerReader::new(plan, tok.clone());
        whole.append(&response(&tok, ids));
        for a in [r.answer(), whole.answer()] {
            assert_eq!(a.reasoning.as_deref(), Some("sum"));
            assert_eq!(a.calls.len(), 1, "{a:?}");
            assert_eq!(a.calls[0].arguments, "{\"a\":1}");
        }
    }

    /// Streamed content is exactly the answer's, for a generic reply cut short too.
    #[test]
    fn streamed_generic_replies_equal_the_answer() {
        let tok = crate::api::test_support::tokenizer(None);
        let plan = OutputPlan {
            tools: Some(ToolParse { format: ToolFormat::Generic, names: vec!["add".into()] }),
            reasoning: None,
        };
        for text in [
            "{\"response\": \"Hi \\u00e9\\n\"}",
            "{\"response\": \"Hi \"",
            "{\"response\": \"Hi",
            "{\"response\": \"  \"}",
        ] {
            let mut r = AnswerReader::new(plan.clone(), tok.clone());
            let mut streamed = String::new();
            for (i, c) in text.char_indices() {
                let part =
                    GenerateResponse { text: c.to_string(), token_ids: vec![300], ..Default::default() };
                let _ = i;
                for p in r.push(&part) {
                    if let Piece::Text(t) = p {
                        streamed.push_str(&t);
                    }
                }
            }
            let (rest, calls) = r.finish();
            for p in rest {
                if let Piece::Text(t) = p {
                    streamed.push_str(&t);
                }
            }
            assert!(calls.is_empty());
            assert_eq!(
                Some(streamed.as_str()).filter(|s| !s.is_empty()),
                r.answer().content.as_deref(),
                "{text}"
            );
        }
    }
}
