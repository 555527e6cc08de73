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
    raw: String,
    /// The answer's first token is a special token that opens calls (Mistral's `[TOOL_CALLS]`),
    /// which the text leaves out.
    marker_lead: Option<bool>,
    /// Bytes of reasoning and of content already shown.
    sent_reasoning: usize,
    sent_text: usize,
}

const MISTRAL_MARK: &str = "[TOOL_CALLS]";

impl AnswerReader {
    pub fn new(plan: OutputPlan, tok: Tokenizer) -> AnswerReader {
        AnswerReader { plan, tok, raw: String::new(), marker_lead: None, sent_reasoning: 0, sent_text: 0 }
    }

    /// The whole text so far, as the formats read it.
    pub fn text(&self) -> String {
        if self.marker_lead == Some(true) {
            format!("{MISTRAL_MARK}{}", self.raw)
        } else {
            self.raw.clone()
        }
    }

    /// Takes in one response's text; gives what may be shown now.
    pub fn push(&mut self, r: &GenerateResponse) -> Vec<Piece> {
        if self.marker_lead.is_none() && self.plan.tools.is_some() {
            if let Some(&first) = r.token_ids.first() {
                let mark = self.tok.token_to_id(MISTRAL_MARK);
                self.marker_lead = Some(mark == Some(first) && self.tok.is_special(first));
            }
        }
        self.raw.push_str(&r.text);
        let text = self.text();
        let (reasoning, answer) = match self.plan.reasoning {
            Some(r) => r.visible(&text),
            None => ("", Some(text.as_str())),
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
        let text = self.text();
        let (reasoning, rest) = match self.plan.reasoning {
            Some(r) => r.split(&text),
            None => (None, text.as_str()),
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
