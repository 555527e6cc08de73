//! Chat templates: a model's Jinja template, compiled and rendered the way transformers does.
//!
//! Invariants:
//! - Rendering follows jinja2 as transformers configures it: `trim_blocks`, `lstrip_blocks`, one
//!   trailing newline of the template dropped, Python string methods available, and
//!   `raise_exception(msg)` failing the render with `msg`. The `trim` filter and the `strip`,
//!   `lstrip`, `rstrip` methods remove what Python counts as whitespace (which adds U+001C to
//!   U+001F to Rust's), as Gemma's templates rely on.
//! - A template sees `messages`, `add_generation_prompt`, `bos_token` / `eos_token` when the
//!   model names them, and `tools` when the request has tools; nothing else.
//! - `strftime_now` formats in UTC with no dependency on the host's locale or time zone.

use std::collections::BTreeMap;

use super::ChatMessage;

/// A compiled chat template.
pub(super) struct ChatTemplate {
    env: minijinja::Environment<'static>,
    /// The Jinja source (read to tell how the template writes tool calls).
    source: String,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    pub(super) fn compile(src: String) -> std::result::Result<ChatTemplate, minijinja::Error> {
        let mut env = minijinja::Environment::new();
        // transformers renders with jinja2's trim_blocks + lstrip_blocks, and jinja2 drops one
        // trailing newline of the template (keep_trailing_newline = False).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(|state, value, method, args| {
            if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
                let (chars,): (Option<&str>,) = minijinja::value::from_args(args)?;
                return Ok(py_strip(s, chars, method != "rstrip", method != "lstrip").into());
            }
            minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
        });
        env.add_filter("trim", |v: minijinja::Value, chars: Option<String>| -> minijinja::Value {
            let s = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            py_strip(&s, chars.as_deref(), true, true).into()
        });
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<minijinja::Value, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", strftime_now);
        // transformers' own `tojson`: Python's json.dumps (", " and ": " separators, keys in their
        // order, non-ASCII as is, no HTML escaping), with its `indent` argument.
        env.add_filter(
            "tojson",
            |v: minijinja::Value,
             kwargs: minijinja::value::Kwargs|
             -> std::result::Result<minijinja::Value, minijinja::Error> {
                let indent: Option<usize> = kwargs.get("indent")?;
                kwargs.assert_all_used()?;
                let json = serde_json::to_value(&v).map_err(|e| {
                    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
                })?;
                let mut out = String::new();
                py_json(&json, indent, 0, &mut out);
                Ok(minijinja::Value::from_safe_string(out))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, src.clone())?;
        Ok(ChatTemplate { env, source: src })
    }

    pub(super) fn source(&self) -> &str {
        &self.source
    }

    /// The compiled template, ready to render with [`context`].
    pub(super) fn template(&self) -> std::result::Result<minijinja::Template<'_, '_>, minijinja::Error> {
        self.env.get_template(TEMPLATE_NAME)
    }
}

/// `json.dumps(v, indent=indent, ensure_ascii=False)` as Python writes it.
fn py_json(v: &serde_json::Value, indent: Option<usize>, level: usize, out: &mut String) {
    use serde_json::Value;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_json(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                py_json(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Python's `str.strip` / `lstrip` / `rstrip`: `chars` given, those characters; else whitespace
/// as `str.isspace` sees it, Unicode White_Space plus the separators U+001C to U+001F.
fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let strip = |c: char| match chars {
        Some(set) => set.contains(c),
        None => c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(strip);
    }
    if right {
        out = out.trim_end_matches(strip);
    }
    out
}

/// The variables a chat template is rendered with.
pub(super) fn context(
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> BTreeMap<&'static str, minijinja::Value> {
    let mut ctx: BTreeMap<&str, minijinja::Value> = BTreeMap::new();
    ctx.insert("messages", minijinja::Value::from_serialize(messages));
    ctx.insert("add_generation_prompt", add_generation_prompt.into());
    if let Some(b) = bos_token {
        ctx.insert("bos_token", b.into());
    }
    if let Some(e) = eos_token {
        ctx.insert("eos_token", e.into());
    }
    ctx
}

/// `strftime_now(fmt)`, which some templates (Llama 3.x) call for today's date. UTC; supports
/// the common `%d %m %Y %y %b %B %H %M %S %%` directives.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format_utc(secs, &fmt)
}

fn format_utc(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian), by 400-year eras.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_utc_known_dates() {
        assert_eq!(format_utc(0, "%d %b %Y"), "01 Jan 1970");
        // 2024-02-29 12:34:56 UTC
        assert_eq!(format_utc(1_709_210_096, "%Y-%m-%d %H:%M:%S %B %%"), "2024-02-29 12:34:56 February %");
    }

    fn render(src: &str, messages: &[ChatMessage]) -> std::result::Result<String, minijinja::Error> {
        let t = ChatTemplate::compile(src.to_owned())?;
        let tmpl = t.template()?;
        tmpl.render(
            minijinja::context! { messages => messages, add_generation_prompt => true, bos_token => "<s>" },
        )
    }

    #[test]
    fn template_python_methods_blocks_and_exceptions() {
        // Python string methods (pycompat), namespace + loop controls, trim/lstrip of block tags,
        // and the trailing newline of the template dropped, as jinja2 does in transformers.
        let src = "{%- set ns = namespace(n=0) -%}\n{{ bos_token }}\n    {% for m in messages %}\n    {% if m.role == 'system' %}{% continue %}{% endif %}\n{{ m.role.upper() }}: {{ m.content.strip() }}{% set ns.n = ns.n + 1 %}\n    {% endfor %}\n{{ ns.n }}{{ '|' if 'x'.startswith('x') }}\n";
        let msgs = [ChatMessage::new("system", "ignored"), ChatMessage::new("user", "  hi  ")];
        // Expected text as transformers' jinja2 renderer produces it for this template.
        assert_eq!(render(src, &msgs).unwrap(), "<s>\nUSER: hi1|");

        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok";
        let err = render(src, &[ChatMessage::new("assistant", "x")]).unwrap_err();
        assert!(format!("{err:#}").contains("first message must be from the user"), "{err:#}");
        assert_eq!(render(src, &[ChatMessage::new("user", "x")]).unwrap(), "ok");

        assert!(ChatTemplate::compile("{% for %}".to_owned()).is_err());
    }

    #[test]
    fn a_message_name_is_defined_only_when_given() {
        // Templates test `message.name is defined` (the Llama 3 and Mistral families do).
        let src = "{% for m in messages %}{{ m.name if m.name is defined else '-' }};{% endfor %}";
        let msgs =
            [ChatMessage::new("user", "x").with_name(Some("ana".into())), ChatMessage::new("user", "y")];
        assert_eq!(render(src, &msgs).unwrap(), "ana;-;");
    }

    #[test]
    fn trim_and_strip_use_python_whitespace() {
        let src = "{{ s | trim }}|{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'xxaxx'.strip('x') }}|{{ 'xxaxx' | trim('x') }}|{{ s.strip('') }}|{{ 42 | trim }}|{{ s.upper() | length }}";
        let t = ChatTemplate::compile(src.to_owned()).unwrap();
        let s = "\u{1c}\u{3000} a b\u{b}\u{85}\u{1f}";
        let got = t.template().unwrap().render(minijinja::context! { s => s }).unwrap();
        // As jinja2 renders it; the last field shows other methods still come from pycompat.
        assert_eq!(
            got,
            format!("a b|a b|a b\u{b}\u{85}\u{1f}|\u{1c}\u{3000} a b|a|a|{s}|42|{}", s.chars().count())
        );
    }
}
