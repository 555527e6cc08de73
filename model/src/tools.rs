//! Tool calling: how a model's chat template writes tool calls ([`ToolFormat`], read from the
//! template), the grammar that forces a call whose arguments validate against the function's
//! JSON Schema ([`forced_call`]), and the calls read back out of the generated text
//! ([`ToolFormat::parse`]).
//!
//! Three families are known, each by what its template writes:
//! - **Hermes** (Qwen 2.5 and 3, Hermes, SmolLM3 and others): each call is
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, after optional text.
//! - **Llama 3.x JSON**: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
//!   `<|python_tag|>`); several calls are separated by `;`.
//! - **Mistral**: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.
//!
//! A template that renders none of these (or no tools at all) gets the **generic** format
//! ([`ToolFormat::Generic`]): the tools are described in a system message ([`generic_messages`]),
//! rendered by the model's own template, and the whole answer is one JSON object, either
//! `{"response": "..."}` or `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, which a grammar
//! enforces ([`generic_reply_or_calls`], [`forced_call`]). A model was never trained on it, so it
//! costs prompt tokens and answers in a shape the model must follow from the description alone.

use serde_json::{json, Map, Value};

use crate::grammar::Constraint;
use crate::tokenizer::Tokenizer;
pub use crate::tokenizer::{TemplateFunction, TemplateToolCall};

/// Longest tool name (OpenAI's limit).
pub const MAX_TOOL_NAME: usize = 64;
/// Most tools one request may define.
pub const MAX_TOOLS: usize = 128;

/// How a chat template writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
    /// For templates without a known format: see the module's documentation.
    Generic,
}

/// One call read out of the generated text: the function's name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// The generated text split into its text part and its calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedOutput {
    /// Text outside the calls (`None` when there is none but whitespace).
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_MARK: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";
/// How a generic-format reply starts, in the grammar's fixed JSON layout.
const GENERIC_REPLY: &str = "{\"response\": \"";

impl ToolFormat {
    /// The format tool calls take on `tok`'s model: the one its chat template writes, else the
    /// generic one; `None` only for a model without a chat template.
    pub fn of(tok: &Tokenizer) -> Option<ToolFormat> {
        tok.chat_template_source().map(|src| ToolFormat::detect(src).unwrap_or(ToolFormat::Generic))
    }

    /// The format a template's source writes, if it renders tools at all.
    pub fn detect(template: &str) -> Option<ToolFormat> {
        // XML-style calls (`<function=name><parameter=...>`, Qwen3-Coder) are another format.
        if !template.contains("tools") || template.contains("<function=") {
            return None;
        }
        if template.contains(HERMES_OPEN) {
            Some(ToolFormat::Hermes)
        } else if template.contains(MISTRAL_MARK) {
            Some(ToolFormat::Mistral)
        } else if template.contains(PYTHON_TAG) || template.contains("ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Generic => "generic",
        }
    }

    /// Whether the model's own template renders the tools (else they are described in a system
    /// message, see [`generic_messages`]).
    pub fn template_renders_tools(self) -> bool {
        self != ToolFormat::Generic
    }

    /// The key the format writes a call's arguments under.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        }
    }

    /// The marker that opens a call in the middle of an answer (Hermes, Mistral).
    fn marker(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes => Some(HERMES_OPEN),
            ToolFormat::Mistral => Some(MISTRAL_MARK),
            ToolFormat::Llama3Json | ToolFormat::Generic => None,
        }
    }

    /// The content a streamed answer may show so far: always a prefix of the content
    /// [`ToolFormat::parse`] gives for any continuation of `text`. For the formats with markers,
    /// the text before what may become a call; for the generic one, the reply's string decoded
    /// as far as it is complete (nothing while the answer may still be calls).
    pub fn visible(self, text: &str) -> std::borrow::Cow<'_, str> {
        if self != ToolFormat::Generic {
            return std::borrow::Cow::Borrowed(&text[..self.safe_prefix(text)]);
        }
        let t = text.trim_start();
        if let Some(rest) = t.strip_prefix(GENERIC_REPLY) {
            return std::borrow::Cow::Owned(json_string_prefix(rest).0);
        }
        if t.is_empty() || t.starts_with('{') {
            return std::borrow::Cow::Borrowed("");
        }
        std::borrow::Cow::Borrowed(text)
    }

    /// The text before any part that may be a call (what streaming can send now): whitespace at
    /// its end is held back too, since the text before a call loses it.
    pub fn safe_prefix(self, text: &str) -> usize {
        let cut = self.call_start(text);
        text[..cut].trim_end().len()
    }

    /// Where a call may begin in `text` (its length when none may): at the marker, or at a start
    /// of it cut by the end of the text; for Llama 3, at the start when the answer may be JSON.
    fn call_start(self, text: &str) -> usize {
        match self.marker() {
            Some(mark) => {
                if let Some(i) = text.find(mark) {
                    return i;
                }
                let lead = mark.as_bytes()[0] as char;
                match text.rfind(lead) {
                    Some(i) if mark.starts_with(&text[i..]) => i,
                    _ => text.len(),
                }
            }
            None => {
                let t = text.trim_start();
                if t.is_empty()
                    || t.starts_with('{')
                    || t.starts_with(PYTHON_TAG)
                    || PYTHON_TAG.starts_with(t)
                {
                    0
                } else {
                    text.len()
                }
            }
        }
    }

    /// Reads the calls out of a finished answer, keeping only calls of the functions named in
    /// `names`. Text that does not parse as the format's calls, or calls a function that is not
    /// among them, stays content, whole: nothing is lost.
    pub fn parse(self, text: &str, names: &[String]) -> ParsedOutput {
        let out = self.parse_any(text);
        if out.calls.iter().all(|c| names.contains(&c.name)) {
            out
        } else {
            ParsedOutput { content: (!text.trim().is_empty()).then(|| text.to_owned()), calls: Vec::new() }
        }
    }

    fn parse_any(self, text: &str) -> ParsedOutput {
        let content = |s: &str| (!s.trim().is_empty()).then(|| s.to_owned());
        let whole = || ParsedOutput { content: content(text), calls: Vec::new() };
        match self {
            ToolFormat::Hermes => {
                let Some(first) = text.find(HERMES_OPEN) else { return whole() };
                let mut calls = Vec::new();
                let mut rest = &text[first..];
                while let Some(after_open) = rest.strip_prefix(HERMES_OPEN) {
                    let Some(end) = after_open.find(HERMES_CLOSE) else { return whole() };
                    match self.call(after_open[..end].trim()) {
                        Some(c) => calls.push(c),
                        None => return whole(),
                    }
                    rest = after_open[end + HERMES_CLOSE.len()..].trim_start();
                }
                if !rest.trim().is_empty() {
                    return whole();
                }
                ParsedOutput { content: content(text[..first].trim_end()), calls }
            }
            ToolFormat::Generic => {
                let t = text.trim();
                // The grammar lets a reply be only `{"response": "..."}`: what its string says so
                // far is the content, exactly as streaming showed it, whether the answer was cut
                // short or not.
                if let Some(rest) = text.trim_start().strip_prefix(GENERIC_REPLY) {
                    let said = json_string_prefix(rest).0;
                    return ParsedOutput { content: (!said.is_empty()).then_some(said), calls: Vec::new() };
                }
                let Ok(Value::Object(o)) = serde_json::from_str::<Value>(t) else { return whole() };
                if let (1, Some(Value::String(reply))) = (o.len(), o.get("response")) {
                    return ParsedOutput { content: content(reply), calls: Vec::new() };
                }
                let items = match (o.len(), o.get("tool_calls"), o.get("tool_call")) {
                    (1, Some(Value::Array(items)), _) if !items.is_empty() => items.clone(),
                    (1, _, Some(one @ Value::Object(_))) => vec![one.clone()],
                    _ => return whole(),
                };
                let mut calls = Vec::new();
                for item in &items {
                    match self.call_value(item) {
                        Some(c) => calls.push(c),
                        None => return whole(),
                    }
                }
                ParsedOutput { content: None, calls }
            }
            ToolFormat::Llama3Json => {
                let t = text.trim();
                let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim();
                if !t.starts_with('{') {
                    return whole();
                }
                let mut calls = Vec::new();
                for part in split_json_objects(t) {
                    match part.and_then(|p| self.call(p)) {
                        Some(c) => calls.push(c),
                        None => return whole(),
                    }
                }
                ParsedOutput { content: None, calls }
            }
            ToolFormat::Mistral => {
                let Some(at) = text.find(MISTRAL_MARK) else { return whole() };
                let Ok(Value::Array(items)) =
                    serde_json::from_str::<Value>(text[at + MISTRAL_MARK.len()..].trim())
                else {
                    return whole();
                };
                let mut calls = Vec::new();
                for item in &items {
                    match self.call_value(item) {
                        Some(c) => calls.push(c),
                        None => return whole(),
                    }
                }
                ParsedOutput { content: content(text[..at].trim_end()), calls }
            }
        }
    }

    fn call(self, json_text: &str) -> Option<ParsedCall> {
        self.call_value(&serde_json::from_str::<Value>(json_text).ok()?)
    }

    fn call_value(self, v: &Value) -> Option<ParsedCall> {
        let o = v.as_object()?;
        let name = o.get("name")?.as_str()?.to_owned();
        let args = o.get(self.arguments_key()).or_else(|| o.get("arguments")).or_else(|| o.get("parameters"));
        let arguments = match args {
            None => "{}".to_owned(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
        };
        Some(ParsedCall { name, arguments })
    }
}

/// Splits `a; b; c` (JSON values separated by `;` and whitespace) into their texts; a part that is
/// not a whole JSON value is `None` (and ends the list).
fn split_json_objects(t: &str) -> Vec<Option<&str>> {
    let is_sep = |c: char| c == ';' || c.is_whitespace();
    let mut out = Vec::new();
    let mut pos = 0;
    loop {
        pos = t.len() - t[pos..].trim_start_matches(is_sep).len();
        if pos >= t.len() {
            return out;
        }
        let mut stream = serde_json::Deserializer::from_str(&t[pos..]).into_iter::<Value>();
        match stream.next() {
            Some(Ok(_)) => {
                let end = pos + stream.byte_offset();
                // The next value must be separated from this one.
                if end < t.len() && !t[end..].starts_with(is_sep) {
                    out.push(None);
                    return out;
                }
                out.push(Some(&t[pos..end]));
                pos = end;
            }
            _ => {
                out.push(None);
                return out;
            }
        }
    }
}

/// The start of a JSON string's body (after its opening quote) decoded as far as it is
/// complete, and whether its closing quote was reached. An escape cut by the end of the text
/// waits; a malformed one ends the decoding there.
fn json_string_prefix(body: &str) -> (String, bool) {
    let mut out = String::new();
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return (out, true),
            '\\' => {
                let Some((_, e)) = chars.next() else { return (out, false) };
                let decoded = match e {
                    '"' => '"',
                    '\\' => '\\',
                    '/' => '/',
                    'b' => '\u{8}',
                    'f' => '\u{c}',
                    'n' => '\n',
                    'r' => '\r',
                    't' => '\t',
                    'u' => {
                        // \uXXXX, or a surrogate pair \uD8xx\uDCxx: decoded by serde when whole.
                        let rest = &body[i..];
                        let high = rest
                            .get(2..6)
                            .and_then(|h| u16::from_str_radix(h, 16).ok())
                            .is_some_and(|u| (0xD800..0xDC00).contains(&u));
                        let take = if high { 12 } else { 6 };
                        let Some(esc) = rest.get(..take) else { return (out, false) };
                        match serde_json::from_str::<String>(&format!("\"{esc}\"")) {
                            Ok(s) => out.push_str(&s),
                            Err(_) => return (out, false),
                        }
                        for _ in 0..take - 2 {
                            chars.next();
                        }
                        continue;
                    }
                    _ => return (out, false),
                };
                out.push(decoded);
            }
            c => out.push(c),
        }
    }
    (out, false)
}

/// A tool the request defines: its name, what it does, and its parameters' JSON Schema.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Value,
}

impl ToolDef {
    /// The tools as OpenAI's `tools` array, the shape chat templates read.
    pub fn openai_json(tools: &[ToolDef]) -> Value {
        Value::Array(
            tools
                .iter()
                .map(|t| {
                    let mut f = json!({"name": t.name, "parameters": t.parameters});
                    if let Some(d) = &t.description {
                        f["description"] = json!(d);
                    }
                    json!({"type": "function", "function": f})
                })
                .collect(),
        )
    }
}

/// `v` as JSON in the layout the grammars write it (`", "` and `": "`, no other whitespace), so
/// that a history shows the model the answers it writes.
pub fn layout_json(v: &Value) -> String {
    match v {
        Value::Array(items) => {
            format!("[{}]", items.iter().map(layout_json).collect::<Vec<_>>().join(", "))
        }
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, v)| format!("{}: {}", Value::from(k.as_str()), layout_json(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

/// The schema of one call of any of `tools` in the generic format.
fn generic_call_schema(tools: &[&ToolDef]) -> Value {
    let one: Vec<Value> = tools
        .iter()
        .map(|t| {
            json!({"type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": false})
        })
        .collect();
    if one.len() == 1 {
        one[0].clone()
    } else {
        json!({"anyOf": one})
    }
}

/// Most calls in one forced answer (any format): a small model that repeats a call cannot fill
/// its whole budget with copies.
pub const MAX_CALLS: usize = 8;

fn generic_calls_schema(tools: &[&ToolDef], parallel: bool) -> Value {
    let most = if parallel { MAX_CALLS } else { 1 };
    let items =
        json!({"type": "array", "items": generic_call_schema(tools), "minItems": 1, "maxItems": most});
    json!({"type": "object", "properties": {"tool_calls": items},
        "required": ["tool_calls"], "additionalProperties": false})
}

/// The generic format's constraint for `tool_choice: auto`: the answer is a reply or calls of
/// any of `tools` (several when `parallel`), arguments valid against their schemas.
pub fn generic_reply_or_calls(tools: &[ToolDef], parallel: bool) -> Constraint {
    let all: Vec<&ToolDef> = tools.iter().collect();
    let reply = json!({"type": "object", "properties": {"response": {"type": "string"}},
        "required": ["response"], "additionalProperties": false});
    let schema = json!({"anyOf": [reply, generic_calls_schema(&all, parallel)]});
    Constraint::JsonSchema(schema.to_string())
}

/// The system text that describes `tools` (OpenAI's `tools` array) and the generic answer format.
pub fn generic_description(tools: &Value) -> String {
    let mut out = String::from(
        "You can call tools. Each tool is given as a JSON object with its name, what it does and the \
         JSON Schema of its arguments:\n",
    );
    for t in tools.as_array().into_iter().flatten() {
        let f = t.get("function").unwrap_or(t);
        let mut d = json!({"name": f.get("name"), "parameters": f.get("parameters")});
        if let Some(desc) = f.get("description").filter(|d| d.is_string()) {
            d["description"] = desc.clone();
        }
        out.push_str(&layout_json(&d));
        out.push('\n');
    }
    out.push_str(
        "Answer with one JSON object and nothing else. To call tools, answer \
         {\"tool_calls\": [{\"name\": \"<tool name>\", \"arguments\": {<its arguments>}}]}. \
         To reply to the user, answer {\"response\": \"<your reply>\"}. A tool's result comes \
         back in a message {\"tool_response\": {\"tool_call_id\": ..., \"name\": ..., \"content\": ...}}.",
    );
    out
}

/// The conversation as a template without tool support is given it in the generic format: the
/// tools (OpenAI's `tools` array, when the request has any) described in the system message
/// (joined to the first one, or a new one in front); earlier calls written as the answers that
/// made them; and tool results as a user message (joined to the user messages beside it, so that
/// roles still alternate).
pub fn generic_messages(
    messages: &[crate::tokenizer::ChatMessage],
    tools: Option<&Value>,
) -> Vec<crate::tokenizer::ChatMessage> {
    use crate::tokenizer::ChatMessage;
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    if let Some(tools) = tools {
        let desc = generic_description(tools);
        match messages.split_first() {
            Some((first, after)) if first.role == "system" => {
                let content =
                    if first.content.is_empty() { desc } else { format!("{}\n\n{desc}", first.content) };
                out.push(ChatMessage { content, ..first.clone() });
                rest = after;
            }
            _ => out.push(ChatMessage::new("system", desc)),
        }
    }
    // The names of earlier calls by id, for the results.
    let mut names: Vec<(String, String)> = Vec::new();
    let mut from_tool = false;
    for m in rest {
        match m.role.as_str() {
            "assistant" if m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()) => {
                let calls = m.tool_calls.as_deref().unwrap_or_default();
                for c in calls {
                    if let Some(id) = &c.id {
                        names.push((id.clone(), c.function.name.clone()));
                    }
                }
                let list: Vec<Value> = calls
                    .iter()
                    .map(|c| json!({"name": c.function.name, "arguments": c.function.arguments}))
                    .collect();
                let mut content = layout_json(&json!({"tool_calls": list}));
                if !m.content.trim().is_empty() {
                    content = format!("{}\n{content}", m.content);
                }
                push_joined(&mut out, ChatMessage { content, tool_calls: None, ..m.clone() });
                from_tool = false;
            }
            "tool" => {
                let id = m.tool_call_id.clone().unwrap_or_default();
                let name = m
                    .name
                    .clone()
                    .or_else(|| names.iter().rev().find(|(i, _)| *i == id).map(|(_, n)| n.clone()));
                let result = layout_json(
                    &json!({"tool_response": {"tool_call_id": id, "name": name, "content": m.content}}),
                );
                match out.last_mut() {
                    Some(last) if last.role == "user" => {
                        last.content = format!("{}\n{result}", last.content);
                    }
                    _ => out.push(ChatMessage::new("user", result)),
                }
                from_tool = true;
            }
            "user" if from_tool => {
                let last = out.last_mut().expect("a tool result came first");
                last.content = format!("{}\n\n{}", last.content, m.content);
                from_tool = false;
            }
            _ => {
                push_joined(&mut out, ChatMessage { tool_calls: None, tool_call_id: None, ..m.clone() });
                from_tool = false;
            }
        }
    }
    out
}

/// Pushes `m`, joined to the last message when both are the assistant's (a call, then its text:
/// templates that insist on alternating roles refuse two in a row).
fn push_joined(out: &mut Vec<crate::tokenizer::ChatMessage>, m: crate::tokenizer::ChatMessage) {
    match out.last_mut() {
        Some(last) if last.role == "assistant" && m.role == "assistant" => {
            last.content = format!("{}\n{}", last.content, m.content);
        }
        _ => out.push(m),
    }
}

/// The generic format's conversation for a template that refuses a system message: the system
/// message's text put in front of the first user message instead.
pub fn fold_system(messages: &[crate::tokenizer::ChatMessage]) -> Option<Vec<crate::tokenizer::ChatMessage>> {
    let (first, rest) = messages.split_first()?;
    if first.role != "system" {
        return None;
    }
    let mut out = rest.to_vec();
    match out.iter_mut().find(|m| m.role == "user") {
        Some(u) => u.content = format!("{}\n\n{}", first.content, u.content),
        None => out.insert(0, crate::tokenizer::ChatMessage::new("user", first.content.clone())),
    }
    Some(out)
}

/// The grammar that forces the answer to be tool calls in `format`: of the tool named `only`, or
/// of any of `tools`; several calls when `parallel` (where the format has them). Every call's
/// arguments validate against its function's parameters schema.
pub fn forced_call(
    format: ToolFormat,
    tools: &[ToolDef],
    only: Option<&str>,
    parallel: bool,
    tok: &Tokenizer,
) -> Result<Constraint, String> {
    let chosen: Vec<&ToolDef> = tools.iter().filter(|t| only.is_none_or(|n| n == t.name)).collect();
    if chosen.is_empty() {
        return Err(match only {
            Some(n) => format!("no tool is named `{n}`"),
            None => "no tools are defined".into(),
        });
    }
    if format == ToolFormat::Generic {
        return Ok(Constraint::JsonSchema(generic_calls_schema(&chosen, parallel).to_string()));
    }
    let key = format.arguments_key();
    let one: Vec<Value> = chosen
        .iter()
        .map(|t| {
            let mut props = Map::new();
            props.insert("name".into(), json!({"const": t.name}));
            props.insert(key.into(), t.parameters.clone());
            json!({"type": "object", "properties": props, "required": ["name", key], "additionalProperties": false})
        })
        .collect();
    let call = if one.len() == 1 { one[0].clone() } else { json!({"anyOf": one}) };
    let layout = json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false});
    let with_layout = |mut v: Value| {
        if let Value::Object(o) = &mut v {
            o.insert("x-guidance".into(), layout.clone());
        }
        v
    };
    let lark = match format {
        ToolFormat::Hermes => {
            let call = with_layout(call);
            let repeat =
                if parallel { format!(" (\"\\n\" call){{0,{}}}", MAX_CALLS - 1) } else { String::new() };
            format!("start: call{repeat}\ncall: \"{HERMES_OPEN}\\n\" %json {call} \"\\n{HERMES_CLOSE}\"\n")
        }
        ToolFormat::Llama3Json => {
            let call = with_layout(call);
            let repeat =
                if parallel { format!(" (\"; \" call){{0,{}}}", MAX_CALLS - 1) } else { String::new() };
            format!("start: call{repeat}\ncall: %json {call}\n")
        }
        ToolFormat::Mistral => {
            let most = if parallel { MAX_CALLS } else { 1 };
            let array = json!({"type": "array", "items": call, "minItems": 1, "maxItems": most});
            let array = with_layout(array);
            let mark = match tok.token_to_id(MISTRAL_MARK) {
                Some(id) if tok.is_special(id) => format!("<[{id}]>"),
                _ => format!("\"{MISTRAL_MARK}\""),
            };
            format!("start: {mark} %json {array}\n")
        }
        ToolFormat::Generic => unreachable!("returned above"),
    };
    Ok(Constraint::Grammar(lark))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_is_told_by_its_template() {
        assert_eq!(ToolFormat::detect("{% if tools %}<tool_call>{% endif %}"), Some(ToolFormat::Hermes));
        assert_eq!(ToolFormat::detect("{% if tools %}[TOOL_CALLS]{% endif %}"), Some(ToolFormat::Mistral));
        assert_eq!(
            ToolFormat::detect("{% if tools %}<|python_tag|>{% endif %}"),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::detect("{{ messages }}"), None, "a template that never reads tools");
        assert_eq!(ToolFormat::detect("{% if tools %}{{ tools }}{% endif %}"), None, "no known call syntax");
        assert_eq!(
            ToolFormat::detect("{% if tools %}<tool_call>\n<function=x>{% endif %}"),
            None,
            "XML-style calls are not Hermes JSON"
        );
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn hermes_calls_come_out_with_the_text_before_them() {
        let f = ToolFormat::Hermes;
        let all = names(&["weather", "time", "x", "a"]);
        let out = f.parse_any("Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>");
        assert_eq!(out.content.as_deref(), Some("Let me look."));
        assert_eq!(
            out.calls,
            vec![
                ParsedCall { name: "weather".into(), arguments: r#"{"city":"Oslo"}"#.into() },
                ParsedCall { name: "time".into(), arguments: "{}".into() },
            ]
        );
        // Broken calls stay text, whole.
        for bad in [
            "<tool_call>\n{\"name\": \"x\"",
            "<tool_call>{nope}</tool_call>",
            "<tool_call>{\"name\": \"a\"}</tool_call> trailing",
        ] {
            let out = f.parse(bad, &all);
            assert!(out.calls.is_empty() && out.content.as_deref() == Some(bad), "{bad:?}: {out:?}");
        }
        assert_eq!(f.parse("plain", &all).content.as_deref(), Some("plain"));
        // A call of a function the request did not define is text.
        let unknown = "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(f.parse(unknown, &all), ParsedOutput { content: Some(unknown.into()), calls: vec![] });
    }

    #[test]
    fn llama3_and_mistral_calls_parse() {
        let ab = names(&["a", "b"]);
        let out = ToolFormat::Llama3Json.parse_any("<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}");
        assert_eq!(out.calls.len(), 2, "{out:?}");
        assert_eq!(out.calls[0], ParsedCall { name: "a".into(), arguments: r#"{"x":1}"#.into() });
        assert_eq!(out.content, None);
        assert_eq!(ToolFormat::Llama3Json.parse("Hello", &ab).content.as_deref(), Some("Hello"));
        assert!(ToolFormat::Llama3Json.parse("{\"name\": \"a\"} junk", &ab).calls.is_empty());
        // A JSON answer that merely has a `name` is not a call of a defined function.
        let person = "{\"name\": \"Alice\", \"age\": 30}";
        assert_eq!(ToolFormat::Llama3Json.parse(person, &ab).content.as_deref(), Some(person));
        let out =
            ToolFormat::Mistral.parse("[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"y\": [1, 2]}}]", &ab);
        assert_eq!(out.calls, vec![ParsedCall { name: "a".into(), arguments: r#"{"y":[1,2]}"#.into() }]);
        assert!(ToolFormat::Mistral.parse("[TOOL_CALLS] not json", &ab).calls.is_empty());
        let out =
            ToolFormat::Mistral.parse("Checking. [TOOL_CALLS][{\"name\": \"b\", \"arguments\": {}}]", &ab);
        assert_eq!((out.content.as_deref(), out.calls.len()), (Some("Checking."), 1));
    }

    #[test]
    fn streaming_holds_back_only_what_may_become_a_call() {
        let h = ToolFormat::Hermes;
        assert_eq!(h.safe_prefix("Hello there"), 11);
        assert_eq!(h.safe_prefix("Hello <tool"), 5);
        assert_eq!(h.safe_prefix("a < b"), 5, "a `<` that cannot open a call is text");
        assert_eq!(h.safe_prefix("a <"), 1);
        assert_eq!(h.safe_prefix("x <tool_call>{"), 1, "the space before a call is not content");
        assert_eq!(h.safe_prefix("Sure.\n"), 5, "trailing whitespace waits");
        assert_eq!(ToolFormat::Llama3Json.safe_prefix(" {\"na"), 0, "a JSON start may be a call");
        assert_eq!(ToolFormat::Llama3Json.safe_prefix("Sure"), 4);
        assert_eq!(ToolFormat::Mistral.safe_prefix("[TOOL"), 0);
        assert_eq!(ToolFormat::Mistral.safe_prefix("Sure"), 4);
        assert_eq!(
            ToolFormat::Mistral.safe_prefix("I'll check. [TOOL_CALLS][{"),
            11,
            "a call after text is held"
        );
        assert_eq!(ToolFormat::Mistral.safe_prefix("see [1]"), 7);
        assert_eq!(ToolFormat::Mistral.safe_prefix("see [TO"), 3);
    }
}
