//! Chat templates for GGUF files that carry none (`tokenizer.chat_template` absent), chosen by the
//! file's `general.architecture`, as llama.cpp does for the same files. Gemma 3 270M's GGUF is
//! one: without a template its chat requests would be refused.
//!
//! Each is written here to render what the family's published template renders for the
//! conversations a chat API sends (`model/tests/tokenizer_spm.rs` compares them on the recorded
//! conversations). A file's own template always wins.

/// Gemma 2 and Gemma 3: turns of `<start_of_turn>{user|model}\n...<end_of_turn>\n`, the assistant
/// named `model`, contents trimmed, a system message prepended to the first user turn (Gemma 2's
/// own template refuses a system message; prepending it is what Gemma 3's does), roles required to
/// alternate.
pub const GEMMA: &str = r#"{{ bos_token }}
{%- set system = messages[0]['content'] ~ '\n\n' if messages and messages[0]['role'] == 'system' else '' -%}
{%- set turns = messages[1:] if system else messages -%}
{%- for m in turns -%}
  {%- if (m['role'] == 'user') != (loop.index0 is even) -%}
    {{ raise_exception('roles must alternate user, assistant, user, ... after an optional system message') }}
  {%- endif -%}
  {{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\n' ~ (system if loop.first else '') ~ (m['content'] | trim) ~ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"#;

/// Phi-3: `<|role|>\n...<|end|>\n` per message, `<|assistant|>\n` to prompt a reply, the EOS
/// token to close a conversation without one.
pub const PHI3: &str = r#"{%- for m in messages -%}
  {%- if m['role'] in ['system', 'user', 'assistant'] -%}
    {{ '<|' ~ m['role'] ~ '|>\n' ~ m['content'] ~ '<|end|>\n' }}
  {%- endif -%}
{%- endfor -%}
{{ '<|assistant|>\n' if add_generation_prompt else eos_token }}"#;

/// The built-in template for a GGUF `general.architecture`, if there is one.
pub fn for_architecture(arch: &str) -> Option<&'static str> {
    match arch {
        "gemma" | "gemma2" | "gemma3" => Some(GEMMA),
        "phi3" => Some(PHI3),
        _ => None,
    }
}
