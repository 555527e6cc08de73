//! Loading a tokenizer from a Hugging Face model directory.
//!
//! `tokenizer.json` is required; `tokenizer_config.json`, `generation_config.json` and
//! `chat_template.jinja` are each optional, and a file that is present but unreadable or not
//! JSON is an error naming it (never silently treated as absent).
//!
//! Invariants:
//! - BOS is prepended when `add_bos_token` says so; without that key, exactly when the
//!   `tokenizer.json` post-processor already adds it (which is then not prepended again).
//! - The EOS set is the config's `eos_token` first, then the generation config's
//!   `eos_token_id` values, each id once.
//! - `chat_template.jinja` wins over the config's `chat_template`, as in transformers.

use std::path::Path;

use crate::error::{ModelError, Result};

use super::{tok_err, Model, Parts, Tokenizer};

/// The tokenizer of the model directory `dir`; see [`Tokenizer::from_hf_dir`].
pub(super) fn load(dir: &Path) -> Result<Tokenizer> {
    let tj = dir.join("tokenizer.json");
    if !tj.is_file() {
        return Err(ModelError::io(
            &tj,
            std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json not found"),
        ));
    }
    let tok = tokenizers::Tokenizer::from_file(&tj).map_err(|e| tok_err(&tj, e))?;
    let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(serde_json::Value::Null);
    let gen_cfg = read_json(&dir.join("generation_config.json"))?.unwrap_or(serde_json::Value::Null);

    let bos_token = special_token_text(cfg.get("bos_token"));
    let eos_token = special_token_text(cfg.get("eos_token"));
    let bos_id = match &bos_token {
        Some(t) => tok.token_to_id(t),
        None => id_list(gen_cfg.get("bos_token_id")).first().copied(),
    };
    let mut eos_ids = Vec::new();
    if let Some(id) = eos_token.as_deref().and_then(|t| tok.token_to_id(t)) {
        eos_ids.push(id);
    }
    for id in id_list(gen_cfg.get("eos_token_id")) {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }

    let jinja = dir.join("chat_template.jinja");
    let template_src = match std::fs::read_to_string(&jinja) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => chat_template_text(cfg.get("chat_template")),
        Err(e) => return Err(ModelError::io(&jinja, e)),
    };

    let post_adds_bos = match bos_id {
        Some(b) => {
            let enc = tok.encode_fast("", true).map_err(|e| tok_err(&tj, e))?;
            enc.get_ids().first() == Some(&b)
        }
        None => false,
    };
    let add_bos = cfg.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(post_adds_bos);
    Tokenizer::assemble(Parts {
        model: Model::Hf(Box::new(tok)),
        source: dir.to_path_buf(),
        bos_id,
        bos_token,
        eos_ids,
        eos_token,
        add_bos,
        post_adds_bos,
        chat_template: template_src,
    })
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| ModelError::format(path, format!("invalid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ModelError::io(path, e)),
    }
}

/// `"bos_token": "<s>"` or `"bos_token": {"content": "<s>", ...}` (older files).
fn special_token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `"chat_template": "..."` or a list of named templates, of which "default" is the chat one.
fn chat_template_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => {
            let named = |n: &str| list.iter().find(|t| t.get("name").and_then(|x| x.as_str()) == Some(n));
            named("default")
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_owned)
        }
        _ => None,
    }
}

/// `eos_token_id` in `generation_config.json` / `config.json`: an int or a list of ints.
fn id_list(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().and_then(|x| u32::try_from(x).ok()).into_iter().collect()
        }
        Some(serde_json::Value::Array(a)) => {
            a.iter().filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect()
        }
        _ => Vec::new(),
    }
}
