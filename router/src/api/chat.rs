//! A chat request as every chat API reads it ([`ChatInput`]), and what it becomes
//! ([`ChatInput::build`]): the chat prompt the router renders, the constraint the workers
//! enforce, and how the output is read back ([`OutputPlan`]).
//!
//! Written once for every API:
//! - **Tools.** The model's tool-call format ([`ToolFormat::of`]): its template's own, or the
//!   generic one for a template that renders no tools. `required` and a named tool are forced by a
//!   grammar in any format; `auto` is too in the generic format (a reply or calls), since the
//!   model was never trained on it.
//! - **Reasoning.** A template that opens a thinking block gets its constraint (structured output
//!   or forced calls) applied after the reasoning ([`Reasoning::constrain`]).
//! - **Checks.** The final constraint is compiled against the model's vocabulary here, so a bad
//!   schema is refused naming the field it came in.

use serde_json::Value;
use tandem_proto::v1::{self, generate_request::Prompt};

use super::{ApiError, Served};
use tandem_model::grammar::Constraint;
use tandem_model::reasoning::Reasoning;
use tandem_model::tools::{
    forced_call, generic_reply_or_calls, ToolDef, ToolFormat, MAX_TOOLS, MAX_TOOL_NAME,
};

/// Which tool the model must call, if any (every API's `tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls: tools are not read out of the answer.
    None,
    /// The model decides.
    Auto,
    /// At least one call, of any tool.
    Required,
    /// A call of this tool.
    Named(String),
}

/// The request's tools and what it asks of them.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub defs: Vec<ToolDef>,
    pub choice: ToolChoice,
    /// Several calls in one answer may be made.
    pub parallel: bool,
}

/// The API's names for the fields of a chat request, for errors.
#[derive(Debug, Clone, Copy)]
pub struct ParamNames {
    pub tools: &'static str,
    pub tool_choice: &'static str,
}

/// How the output of a chat is read back: its tool calls, its reasoning.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputPlan {
    /// Calls are read out of the answer in this format, of these tools.
    pub tools: Option<ToolParse>,
    /// The answer starts with reasoning (or may), split from the content.
    pub reasoning: Option<Reasoning>,
}

impl OutputPlan {
    /// Whether the text goes out as it comes (no tools to read, no reasoning to split).
    pub fn is_plain(&self) -> bool {
        self.tools.is_none() && self.reasoning.is_none()
    }
}

/// How to read tool calls out of an answer: the format, and the functions the request defines
/// (a call of any other is text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolParse {
    pub format: ToolFormat,
    pub names: Vec<String>,
}

/// A chat request as the APIs read it.
#[derive(Debug, Clone, Default)]
pub struct ChatInput {
    pub messages: Vec<v1::ChatMessage>,
    pub tools: Option<ToolSpec>,
    /// A structured-output constraint, with the field it came in.
    pub constraint: Option<(String, Constraint)>,
    /// The template's thinking switch, when the request sets it.
    pub enable_thinking: Option<bool>,
}

/// What a chat request becomes.
#[derive(Debug, Clone)]
pub struct ChatPlan {
    pub prompt: Prompt,
    pub constraint: Option<Constraint>,
    pub output: OutputPlan,
}

impl ChatInput {
    /// The prompt, the constraint and the output plan; every refusal names the API's field.
    pub fn build(self, served: &Served<'_>, names: ParamNames) -> Result<ChatPlan, ApiError> {
        let tok = served.tokenizer;
        let reasoning = tok.and_then(|t| Reasoning::of(t, self.enable_thinking));
        let mut constraint = self.constraint;
        let mut tools_json = String::new();
        let mut parse = None;
        if let Some(spec) = self.tools {
            let bad = |m: &str| ApiError::invalid(names.tools, format!("{}: {m}", names.tools));
            let tok = tok.ok_or_else(|| bad("the model's tokenizer is needed to read tool calls"))?;
            let format = ToolFormat::of(tok)
                .ok_or_else(|| bad("the model has no chat template, so it cannot be given tools"))?;
            if spec.choice != ToolChoice::None || format.template_renders_tools() {
                tools_json = ToolDef::openai_json(&spec.defs).to_string();
            }
            let only = match &spec.choice {
                ToolChoice::Named(n) => Some(n.as_str()),
                _ => None,
            };
            let forced = match spec.choice {
                // A named tool is one call of it (as vLLM forces it); `required` may make several
                // when parallel calls are allowed.
                ToolChoice::Required | ToolChoice::Named(_) => {
                    let parallel = spec.parallel && only.is_none();
                    Some(forced_call(format, &spec.defs, only, parallel, tok).map_err(|e| {
                        ApiError::invalid(names.tool_choice, format!("{}: {e}", names.tool_choice))
                    })?)
                }
                ToolChoice::Auto if format == ToolFormat::Generic => {
                    Some(generic_reply_or_calls(&spec.defs, spec.parallel))
                }
                _ => None,
            };
            if let Some(forced) = forced {
                if let Some((param, _)) = &constraint {
                    let why = if only.is_some() || matches!(spec.choice, ToolChoice::Required) {
                        format!(
                            "{param}: cannot be combined with {} `required` or a named tool",
                            names.tool_choice
                        )
                    } else {
                        format!(
                            "{param}: cannot be combined with tools on this model: its chat template has \
                             no tool-call format, so tools use the generic format, which constrains the \
                             whole answer (set {} to none to use {param})",
                            names.tool_choice
                        )
                    };
                    return Err(ApiError::invalid(param, why));
                }
                // Compiled below with the rest: a parameters schema the constraint engine cannot
                // use is the tools' fault.
                constraint = Some((names.tools.to_owned(), forced));
            }
            if spec.choice != ToolChoice::None {
                parse = Some(ToolParse { format, names: spec.defs.iter().map(|d| d.name.clone()).collect() });
            }
        }
        let constraint = match constraint {
            None => None,
            Some((param, c)) => {
                let c = match (reasoning, tok) {
                    (Some(r), Some(tok)) => r
                        .constrain(&c, tok)
                        .map_err(|e| ApiError::invalid(&param, format!("{param}: {e}")))?,
                    _ => c,
                };
                if let Some(tok) = tok {
                    let env =
                        tok.grammar().map_err(|e| ApiError::invalid(&param, format!("{param}: {e}")))?;
                    env.compile(&c).map_err(|e| {
                        ApiError::invalid(&param, format!("{param}: invalid {}: {e}", c.kind()))
                    })?;
                }
                Some(c)
            }
        };
        Ok(ChatPlan {
            prompt: Prompt::Chat(v1::ChatPrompt {
                messages: self.messages,
                add_generation_prompt: Some(true),
                tools_json,
                enable_thinking: self.enable_thinking,
            }),
            constraint,
            output: OutputPlan { tools: parse, reasoning },
        })
    }
}

/// Checks a tool's name (OpenAI's rule: 1 to 64 letters, digits, `_` or `-`) and that it is not
/// defined twice; `at` names the field in errors.
pub fn check_tool_name(name: &str, defs: &[ToolDef], at: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TOOL_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !ok {
        return Err(ApiError::invalid(
            at,
            format!("{at}: tool name `{name}` must be 1 to {MAX_TOOL_NAME} letters, digits, `_` or `-`"),
        ));
    }
    if defs.iter().any(|d| d.name == name) {
        return Err(ApiError::invalid(at, format!("{at}: tool name `{name}` is defined twice")));
    }
    Ok(())
}

/// Checks the number of tools; `param` names the field.
pub fn check_tool_count(n: usize, param: &str) -> Result<(), ApiError> {
    if n > MAX_TOOLS {
        return Err(ApiError::invalid(param, format!("{param}: at most {MAX_TOOLS} tools, got {n}")));
    }
    Ok(())
}

/// A tool's parameters schema: an object (absent means any object); `at` names the field.
pub fn tool_parameters(v: Option<&Value>, at: &str) -> Result<Value, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(serde_json::json!({"type": "object"})),
        Some(p @ Value::Object(_)) => Ok(p.clone()),
        Some(_) => Err(ApiError::invalid(at, format!("{at}: must be a JSON Schema object"))),
    }
}

/// Checks that `name` is among the tools (for a named `tool_choice`).
pub fn check_named(name: &str, defs: &[ToolDef], param: &str) -> Result<(), ApiError> {
    if !defs.iter().any(|d| d.name == name) {
        return Err(ApiError::invalid(
            param,
            format!("{param}: unknown tool name `{name}` (not among the request's tools)"),
        ));
    }
    Ok(())
}
