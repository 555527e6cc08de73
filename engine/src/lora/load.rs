//! Reading adapters from disk: PEFT directories and llama.cpp GGUF LoRA files.
//!
//! **PEFT** (`adapter_config.json` + `adapter_model.safetensors`, tensors F32, F16 or BF16): a
//! tensor `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` is A
//! (`[r, in]`) and `...lora_B.weight` is B (`[out, r]`). Modules: `q_proj`, `k_proj`, `v_proj`,
//! `o_proj`, `gate_proj`, `up_proj`, `down_proj`, and Phi-3's fused `qkv_proj` (B's rows are the
//! query's `heads × head_dim`, then the key's and the value's `kv_heads × head_dim`; A is shared)
//! and `gate_up_proj` (gate rows, then up rows). The scale is `lora_alpha / r`, or
//! `lora_alpha / √r` with `use_rslora`. `rank_pattern` and `alpha_pattern` are honoured with
//! PEFT's rule (the first key, in file order, that matches the module's name as the regex
//! `(.*\.)?(KEY)$`), for keys made of letters, digits, `_`, `-` and `.` (any character, as in a
//! regex); a key with other regex syntax is refused by name. Refused by name: a `peft_type`
//! other than LORA, DoRA and PEFT's other LoRA variants, biases, `modules_to_save`, trainable
//! tokens, layer replication, parameter targets, any other module (embeddings, `lm_head`, MoE
//! experts), an A without its B, ranks that disagree with the config, and shapes that do not fit
//! the base model ([`LoraAdapter::new`]).
//!
//! **GGUF** (llama.cpp's format, as `convert_lora_to_gguf.py` writes it): `general.type =
//! adapter`, `adapter.type = lora`, `adapter.lora.alpha`; tensors `blk.{i}.{name}.weight.lora_a`
//! (GGML dims `[in, r]`: A, row-major) and `.lora_b` (dims `[r, out]`: B), any type the engine
//! dequantizes (F32, F16, BF16, Q8_0, ...). Names: `attn_q`, `attn_k`, `attn_v`, `attn_output`,
//! `ffn_gate`, `ffn_up`, `ffn_down`, and for Phi-3 `attn_qkv` and `ffn_up` (fused gate and up,
//! as llama.cpp keeps Phi-3's). The scale is llama.cpp's: `alpha / r`, or 1 when alpha is 0 or
//! absent. The converter knows nothing of rsLoRA (it copies `lora_alpha`), so an rsLoRA adapter
//! converted by it runs at `alpha / r` here as in llama.cpp. For Llama and Mistral files (GGUF
//! architecture `llama` or `mistral`) the converter interleaves the rotary halves of B's rows for
//! Q and K as it does the base weights' (`LoraTorchTensor` applies `LlamaModel.permute` to B
//! only); they are put back as [`crate::models::llama::unpermute_rope_rows`] puts back the base
//! model's. A file whose `general.architecture` is not the base model's is refused.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{LoraAdapter, LoraTarget, LoraWeight, Proj};
use crate::config::{Arch, ModelConfig};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::safetensors::SafeTensors;

/// Reads the adapter at `path` (a PEFT directory with `adapter_config.json` and
/// `adapter_model.safetensors`, or a GGUF LoRA file) for the base model `c`, naming it `name`.
pub fn load(name: &str, path: &Path, c: &ModelConfig) -> Result<LoraAdapter> {
    let meta = std::fs::metadata(path).map_err(|e| bad(path, format!("cannot read it: {e}")))?;
    if meta.is_dir() {
        return load_peft(name, path, c);
    }
    let mut magic = [0u8; 4];
    let read = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic));
    if read.is_ok() && &magic == b"GGUF" {
        return load_gguf(name, path, c);
    }
    let file = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if matches!(file, "adapter_config.json" | "adapter_model.safetensors") {
        return Err(bad(path, "name the PEFT adapter's directory, not one of its files".into()));
    }
    Err(bad(
        path,
        "neither a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) nor a GGUF file"
            .into(),
    ))
}

fn bad(path: &Path, msg: String) -> EngineError {
    EngineError::Lora { path: path.into(), msg }
}

/// The modules a PEFT adapter may target, and what they are here.
enum Module {
    One(Proj),
    /// Phi-3's `qkv_proj`.
    Qkv,
    /// Phi-3's `gate_up_proj`.
    GateUp,
}

const PEFT_MODULES: &str =
    "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, qkv_proj, gate_up_proj";

fn peft_module(name: &str) -> Option<Module> {
    Some(match name {
        "qkv_proj" => Module::Qkv,
        "gate_up_proj" => Module::GateUp,
        _ => Module::One(Proj::ALL.into_iter().find(|p| p.peft_name() == name)?),
    })
}

/// The `(layer, module)` of a module path as PEFT names it (`model.layers.3.self_attn.q_proj`);
/// `Err` says what is wrong with it.
fn parse_module_path(m: &str) -> std::result::Result<(u32, &str), String> {
    let rest = ["model.layers.", "model.language_model.layers."]
        .iter()
        .find_map(|p| m.strip_prefix(p))
        .ok_or_else(|| format!("module `{m}` is not in the decoder's layers (model.layers.N)"))?;
    let parts: Vec<&str> = rest.split('.').collect();
    let layer = parts.first().and_then(|l| l.parse::<u32>().ok());
    match (layer, &parts[1..]) {
        (Some(l), [parent, module]) if matches!(*parent, "self_attn" | "mlp") => {
            if peft_module(module).is_some() {
                Ok((l, module))
            } else {
                Err(format!(
                    "module `{m}`: `{module}` is not a module adapters may target here ({PEFT_MODULES})"
                ))
            }
        }
        _ => Err(format!(
            "module `{m}` is not a projection adapters may target here ({PEFT_MODULES} of self_attn or mlp)"
        )),
    }
}

/// One `rank_pattern` / `alpha_pattern`: its keys in file order (PEFT takes the first that
/// matches).
#[derive(Default)]
struct Pattern(Vec<(String, f64)>);

impl<'de> serde::Deserialize<'de> for Pattern {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Pattern, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Pattern;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object of numbers")
            }
            fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<Pattern, E> {
                Ok(Pattern::default())
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Pattern, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = m.next_entry::<String, f64>()? {
                    out.push((k, v));
                }
                Ok(Pattern(out))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(serde::Deserialize)]
struct Patterns {
    #[serde(default)]
    rank_pattern: Pattern,
    #[serde(default)]
    alpha_pattern: Pattern,
}

impl Pattern {
    /// Refuses keys with regex syntax beyond literal characters and `.`.
    fn check(&self, what: &str) -> std::result::Result<(), String> {
        for (k, v) in &self.0 {
            if k.is_empty()
                || !k.chars().all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '_' | '-' | '.'))
            {
                return Err(format!(
                    "{what} key {k:?} uses regex syntax this loader does not read (keys of letters, digits, \
                     '_', '-' and '.' are read)"
                ));
            }
            if !v.is_finite() || (what == "rank_pattern" && (*v < 1.0 || v.fract() != 0.0)) {
                return Err(format!("{what} value {v} for {k:?} is invalid"));
            }
        }
        Ok(())
    }

    /// PEFT's `get_pattern_key`: the value of the first key matching `module` as `(.*\.)?(KEY)$`.
    fn get(&self, module: &str) -> Option<f64> {
        self.0.iter().find(|(k, _)| pattern_matches(k, module)).map(|(_, v)| *v)
    }
}

/// Whether `name` matches the regex `(.*\.)?(key)$` from its start, for a key whose `.` match any
/// character and whose other characters are literal.
fn pattern_matches(key: &str, name: &str) -> bool {
    let (k, n) = (key.as_bytes(), name.as_bytes());
    (0..=n.len()).filter(|&s| s == 0 || n[s - 1] == b'.').any(|s| {
        let tail = &n[s..];
        tail.len() == k.len() && tail.iter().zip(k).all(|(&c, &p)| p == b'.' || c == p)
    })
}

/// A number from the config (absent: PEFT's default).
fn num(cfg: &Value, key: &str, default: f64) -> std::result::Result<f64, String> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| format!("{key} is {v}, not a number")),
    }
}

/// Whether a config value is set (not absent, null, false, empty or zero-length).
fn is_set(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// Checks `adapter_config.json`; returns `(r, lora_alpha, use_rslora, patterns)`.
fn check_peft_config(cfg: &Value, text: &str) -> std::result::Result<(f64, f64, bool, Patterns), String> {
    match cfg.get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        Some(other) => return Err(format!("peft_type is {other}; only LORA adapters are supported")),
        None => {
            return Err(
                "adapter_config.json has no peft_type (PEFT writes \"LORA\" for a LoRA adapter)".into()
            )
        }
    }
    // PEFT's LoRA variants change the forward pass; so do these options.
    for (key, what) in [
        ("use_dora", "DoRA (use_dora)"),
        ("use_qalora", "QA-LoRA (use_qalora)"),
        ("use_bdlora", "BD-LoRA (use_bdlora)"),
        ("velora_config", "VeLoRA (velora_config)"),
        ("kasa_config", "KaSA (kasa_config)"),
        ("monteclora_config", "MonteCLoRA (monteclora_config)"),
        ("arrow_config", "Arrow routing (arrow_config)"),
        ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
        ("lora_bias", "a bias on lora_B (lora_bias)"),
        ("modules_to_save", "modules_to_save (whole modules trained and saved with the adapter)"),
        ("trainable_token_indices", "trainable tokens (trainable_token_indices)"),
        ("layer_replication", "layer replication (layer_replication)"),
        ("target_parameters", "parameter targets (target_parameters, e.g. MoE experts)"),
    ] {
        if is_set(cfg.get(key)) {
            return Err(format!("{what} is not supported: {} = {}", key, cfg[key]));
        }
    }
    match cfg.get("bias") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "none" => {}
        Some(v) => return Err(format!("bias = {v} is not supported (only \"none\": no bias is trained)")),
    }
    if let Some(Value::Array(mods)) = cfg.get("target_modules") {
        for m in mods {
            let m = m.as_str().ok_or_else(|| format!("target_modules holds {m}, not a module name"))?;
            let last = m.rsplit('.').next().unwrap_or(m);
            if peft_module(last).is_none() {
                return Err(format!(
                    "target module `{m}` is not one an adapter may target here ({PEFT_MODULES})"
                ));
            }
        }
    }
    let r = num(cfg, "r", 8.0)?;
    if r < 1.0 || r.fract() != 0.0 {
        return Err(format!("r = {r} is not a positive integer"));
    }
    let alpha = num(cfg, "lora_alpha", 8.0)?;
    let rslora = match cfg.get("use_rslora") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(format!("use_rslora is {v}, not a boolean")),
    };
    let patterns: Patterns =
        serde_json::from_str(text).map_err(|e| format!("rank_pattern / alpha_pattern: {e}"))?;
    patterns.rank_pattern.check("rank_pattern")?;
    patterns.alpha_pattern.check("alpha_pattern")?;
    Ok((r, alpha, rslora, patterns))
}

/// A tensor read as f32: its shape and values.
struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

/// Every tensor of a safetensors file, widened to f32 (F32, F16 and BF16), through the model
/// loader's reader (the message names the file and the tensor).
fn read_safetensors(path: &Path) -> std::result::Result<BTreeMap<String, Tensor>, String> {
    let st = SafeTensors::open_file(path).map_err(|e| e.to_string())?;
    let mut out = BTreeMap::new();
    for name in st.names() {
        let (shape, data) = st.values(name).map_err(|e| e.to_string())?;
        out.insert(name.to_string(), Tensor { shape, data });
    }
    Ok(out)
}

fn load_peft(name: &str, dir: &Path, c: &ModelConfig) -> Result<LoraAdapter> {
    let cfg_path = dir.join("adapter_config.json");
    let st_path = dir.join("adapter_model.safetensors");
    if !cfg_path.is_file() {
        return Err(bad(
            dir,
            "no adapter_config.json in this directory (a PEFT adapter has adapter_config.json and \
             adapter_model.safetensors)"
                .into(),
        ));
    }
    let text =
        std::fs::read_to_string(&cfg_path).map_err(|e| bad(&cfg_path, format!("cannot read it: {e}")))?;
    let cfg: Value = serde_json::from_str(&text).map_err(|e| bad(&cfg_path, format!("invalid JSON: {e}")))?;
    let (r, alpha, rslora, patterns) = check_peft_config(&cfg, &text).map_err(|m| bad(&cfg_path, m))?;
    if !st_path.is_file() {
        let msg = if dir.join("adapter_model.bin").exists() {
            "no adapter_model.safetensors, only adapter_model.bin (a pickled PyTorch file, which is not \
             read: save the adapter with safe_serialization=True)"
        } else {
            "no adapter_model.safetensors in this directory"
        };
        return Err(bad(dir, msg.into()));
    }
    let tensors = read_safetensors(&st_path).map_err(|m| bad(dir, m))?;

    // (layer, module) → (module path, (A, B))
    type Pair = (Option<Tensor>, Option<Tensor>);
    let mut pairs: BTreeMap<(u32, String), (String, Pair)> = BTreeMap::new();
    for (tname, t) in tensors {
        let not_lora = || {
            bad(
                dir,
                format!(
                    "tensor `{tname}` is not a LoRA A or B weight of a projection adapters may target \
                     ({PEFT_MODULES}); embeddings, lm_head and saved modules are not supported"
                ),
            )
        };
        let (module_path, is_a) = match tname.strip_prefix("base_model.model.") {
            Some(rest) => match (rest.strip_suffix(".lora_A.weight"), rest.strip_suffix(".lora_B.weight")) {
                (Some(m), _) => (m, true),
                (_, Some(m)) => (m, false),
                _ => return Err(not_lora()),
            },
            None => return Err(not_lora()),
        };
        let (layer, module) =
            parse_module_path(module_path).map_err(|m| bad(dir, format!("tensor `{tname}`: {m}")))?;
        let entry = pairs
            .entry((layer, module.to_string()))
            .or_insert_with(|| (module_path.to_string(), (None, None)));
        let slot = if is_a { &mut entry.1 .0 } else { &mut entry.1 .1 };
        *slot = Some(t);
    }

    let ff = c.intermediate_size;
    let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let mut weights = Vec::new();
    for ((layer, module), (path, (a, b))) in pairs {
        let what = format!("{module} of layer {layer}");
        let (a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (Some(_), None) => return Err(bad(dir, format!("{what}: lora_A has no lora_B"))),
            (None, _) => return Err(bad(dir, format!("{what}: lora_B has no lora_A"))),
        };
        if a.shape.len() != 2 || b.shape.len() != 2 || a.shape[0] != b.shape[1] {
            return Err(bad(
                dir,
                format!("{what}: lora_A is {:?} and lora_B {:?}, not [r, in] and [out, r]", a.shape, b.shape),
            ));
        }
        let rank = a.shape[0];
        let want_r = patterns.rank_pattern.get(&path).unwrap_or(r);
        if rank as f64 != want_r {
            return Err(bad(
                dir,
                format!("{what}: the weights have rank {rank} but adapter_config.json gives r = {want_r}"),
            ));
        }
        let alpha = patterns.alpha_pattern.get(&path).unwrap_or(alpha);
        let scale = if rslora { alpha / (rank as f64).sqrt() } else { alpha / rank as f64 } as f32;
        let one = |proj: Proj, b: Vec<f32>| LoraWeight {
            target: LoraTarget { layer, proj },
            rank,
            a: a.data.clone(),
            b,
            scale,
        };
        // Splits B's rows into parts of the given heights.
        let split = |heights: &[(Proj, usize)], parts: &str| -> Result<Vec<LoraWeight>> {
            let total: usize = heights.iter().map(|x| x.1).sum();
            if b.shape[0] != total {
                return Err(bad(
                    dir,
                    format!(
                        "{what}: lora_B has {} rows, but the base model's {parts} projections have {total} \
                         together",
                        b.shape[0]
                    ),
                ));
            }
            let mut at = 0;
            Ok(heights
                .iter()
                .map(|&(p, n)| {
                    let part = b.data[at * rank..(at + n) * rank].to_vec();
                    at += n;
                    one(p, part)
                })
                .collect())
        };
        match peft_module(&module).expect("checked when parsed") {
            Module::One(p) => weights.push(one(p, b.data.clone())),
            Module::Qkv => {
                weights.extend(split(&[(Proj::Q, qd), (Proj::K, kvd), (Proj::V, kvd)], "q, k and v")?)
            }
            Module::GateUp => weights.extend(split(&[(Proj::Gate, ff), (Proj::Up, ff)], "gate and up")?),
        }
    }
    LoraAdapter::new(name, dir, weights, c)
}

/// Whether a GGUF file's `general.architecture` is the base model's.
fn gguf_arch_fits(file_arch: &str, arch: Arch) -> bool {
    let want: &[&str] = match arch {
        // llama.cpp's converter writes Mistral and Mixtral models as `llama`.
        Arch::Llama | Arch::Mistral | Arch::Mixtral => &["llama", "mistral"],
        Arch::Qwen2 => &["qwen2"],
        Arch::Qwen3 => &["qwen3"],
        Arch::Qwen3Moe => &["qwen3moe"],
        Arch::Gemma2 => &["gemma2"],
        Arch::Gemma3 => &["gemma3"],
        Arch::Phi3 => &["phi3"],
    };
    want.contains(&file_arch)
}

/// Puts back the rows of a Q or K projection's B (`rows × rank`) that llama.cpp's converter
/// interleaved per head (pairs `(2j, 2j+1)` ← halves `j`, `j + head_dim/2`), as
/// [`crate::models::llama::unpermute_rope_rows`] does for the base weights.
fn unpermute_rows(b: &[f32], rank: usize, n_heads: usize) -> Vec<f32> {
    let rows = b.len() / rank;
    let hd = rows / n_heads;
    let half = hd / 2;
    let mut out = vec![0f32; b.len()];
    for head in 0..n_heads {
        for t in 0..2 {
            for j in 0..half {
                let dst = head * hd + t * half + j;
                let src = head * hd + 2 * j + t;
                out[dst * rank..(dst + 1) * rank].copy_from_slice(&b[src * rank..(src + 1) * rank]);
            }
        }
    }
    out
}

/// A GGUF reader error as this adapter's error (the message without the path, which the
/// adapter error names).
fn gguf_err(path: &Path, e: EngineError) -> EngineError {
    let msg = match e {
        EngineError::Io { source, .. } => format!("cannot read it: {source}"),
        EngineError::Format { msg, .. } | EngineError::Unsupported { msg, .. } => msg,
        EngineError::MissingTensor { tensor, .. } => format!("missing tensor `{tensor}`"),
        other => other.to_string(),
    };
    bad(path, msg)
}

fn load_gguf(name: &str, path: &Path, c: &ModelConfig) -> Result<LoraAdapter> {
    let g = GgufFile::open(path).map_err(|e| gguf_err(path, e.into()))?;
    let s = |key: &str| g.get(key).and_then(|v| v.as_str());
    match s("general.type") {
        Some("adapter") => {}
        Some(other) => {
            return Err(bad(
                path,
                format!("general.type is {other:?}, not \"adapter\": this GGUF file is not a LoRA adapter"),
            ))
        }
        None => {
            return Err(bad(
                path,
                "no general.type: a llama.cpp LoRA adapter has general.type = \"adapter\"".into(),
            ))
        }
    }
    match s("adapter.type") {
        Some("lora") => {}
        other => {
            return Err(bad(path, format!("adapter.type is {other:?}; only \"lora\" adapters are supported")))
        }
    }
    if g.get("adapter.alora.invocation_tokens").is_some() {
        return Err(bad(path, "activated LoRA (adapter.alora.invocation_tokens) is not supported".into()));
    }
    let arch = s("general.architecture").ok_or_else(|| bad(path, "no general.architecture".into()))?;
    if !gguf_arch_fits(arch, c.arch) {
        return Err(bad(
            path,
            format!("the adapter is for architecture {arch:?}, but the base model is {:?}", c.arch),
        ));
    }
    let permuted = matches!(arch, "llama" | "mistral");
    let alpha = match g.get("adapter.lora.alpha") {
        None => 0.0,
        Some(v) => v
            .as_f64()
            .filter(|a| a.is_finite())
            .ok_or_else(|| bad(path, "adapter.lora.alpha is not a number".into()))? as f32,
    };

    // (layer, name) → (lora_a, lora_b) infos
    let mut pairs: BTreeMap<(u32, String), (Option<usize>, Option<usize>)> = BTreeMap::new();
    for (i, t) in g.tensors.iter().enumerate() {
        let parsed = t.name.strip_prefix("blk.").and_then(|rest| {
            let (layer, rest) = rest.split_once('.')?;
            let layer = layer.parse::<u32>().ok()?;
            let (base, ab) = rest.rsplit_once(".weight.lora_")?;
            Some((layer, base, ab))
        });
        let known = |b: &str| {
            matches!(b, "attn_q" | "attn_k" | "attn_v" | "attn_output" | "ffn_gate" | "ffn_up" | "ffn_down")
                || (c.arch == Arch::Phi3 && b == "attn_qkv")
        };
        match parsed {
            Some((layer, base, ab @ ("a" | "b"))) if known(base) => {
                let e = pairs.entry((layer, base.to_string())).or_default();
                if ab == "a" {
                    e.0 = Some(i);
                } else {
                    e.1 = Some(i);
                }
            }
            _ => {
                return Err(bad(
                    path,
                    format!(
                    "tensor `{}` is not a LoRA A or B of a projection adapters may target (blk.N.{{attn_q, \
                         attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down}}.weight.lora_a/lora_b)",
                    t.name
                ),
                ))
            }
        }
    }
    let read = |i: usize| -> Result<(Vec<usize>, Vec<f32>)> {
        let info = &g.tensors[i];
        let d = &info.dims;
        if d.len() < 2 || d[2..].iter().any(|&x| x != 1) {
            return Err(bad(path, format!("tensor `{}` has dims {:?}, not a matrix", info.name, d)));
        }
        if d[0] % info.dtype.block_len() != 0 {
            return Err(bad(
                path,
                format!("tensor `{}`: rows of {} are not whole {} blocks", info.name, d[0], info.dtype),
            ));
        }
        let mut out = vec![0f32; d[0] * d[1]];
        crate::quant::dequantize(info.dtype, &g.bytes()[g.tensor_range(info)], &mut out)
            .map_err(|e| bad(path, format!("tensor `{}`: {e}", info.name)))?;
        Ok((vec![d[0], d[1]], out))
    };
    let (qd, kvd, ff) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
    let mut weights = Vec::new();
    for ((layer, base), (a, b)) in pairs {
        let what = format!("blk.{layer}.{base}");
        let (a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (Some(_), None) => return Err(bad(path, format!("{what}: lora_a has no lora_b"))),
            (None, _) => return Err(bad(path, format!("{what}: lora_b has no lora_a"))),
        };
        let ((ad, a), (bd, b)) = (read(a)?, read(b)?);
        // GGML dims: A is [in, r] (r rows of `in`), B is [r, out] (out rows of r).
        let rank = ad[1];
        if bd[0] != rank {
            return Err(bad(path, format!("{what}: lora_a has rank {rank} but lora_b {}", bd[0])));
        }
        let scale = if alpha == 0.0 { 1.0 } else { alpha / rank as f32 };
        let one = |proj: Proj, b: Vec<f32>| LoraWeight {
            target: LoraTarget { layer, proj },
            rank,
            a: a.clone(),
            b,
            scale,
        };
        let split = |parts: &[(Proj, usize)]| -> Result<Vec<LoraWeight>> {
            let total: usize = parts.iter().map(|x| x.1).sum();
            if bd[1] != total {
                return Err(bad(
                    path,
                    format!(
                        "{what}: lora_b has {} rows, but the base model's projections it fuses have {total}",
                        bd[1]
                    ),
                ));
            }
            let mut at = 0;
            Ok(parts
                .iter()
                .map(|&(p, n)| {
                    let part = b[at * rank..(at + n) * rank].to_vec();
                    at += n;
                    one(p, part)
                })
                .collect())
        };
        let unpermute = |b: Vec<f32>, heads: usize| {
            if permuted && b.len() == rank * heads * c.head_dim {
                unpermute_rows(&b, rank, heads)
            } else {
                b
            }
        };
        match base.as_str() {
            "attn_q" => weights.push(one(Proj::Q, unpermute(b, c.num_heads))),
            "attn_k" => weights.push(one(Proj::K, unpermute(b, c.num_kv_heads))),
            "attn_v" => weights.push(one(Proj::V, b)),
            "attn_output" => weights.push(one(Proj::O, b)),
            "ffn_gate" => weights.push(one(Proj::Gate, b)),
            // llama.cpp keeps Phi-3's gate and up fused in ffn_up.
            "ffn_up" if c.arch == Arch::Phi3 => weights.extend(split(&[(Proj::Gate, ff), (Proj::Up, ff)])?),
            "ffn_up" => weights.push(one(Proj::Up, b)),
            "ffn_down" => weights.push(one(Proj::Down, b)),
            "attn_qkv" => weights.extend(split(&[(Proj::Q, qd), (Proj::K, kvd), (Proj::V, kvd)])?),
            _ => unreachable!("names checked above"),
        }
    }
    LoraAdapter::new(name, path, weights, c)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::gguf::test_file::{f32_bytes, write_tmp, Writer};

    /// A Llama of hidden 8, 2 heads / 1 KV head of 4, ffn 12, 2 layers (or another `model_type`
    /// of the same shape).
    fn config(model_type: &str) -> ModelConfig {
        let json = format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 8, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 12, "num_hidden_layers": 2,
            "vocab_size": 16}}"#
        );
        ModelConfig::from_hf_json(Path::new("config.json"), &json).unwrap()
    }

    fn tmp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-lora-load-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `n` distinct values (exact in bf16 and f16).
    fn vals(n: usize, from: f32) -> Vec<f32> {
        (0..n).map(|i| from + 0.25 * i as f32).collect()
    }

    /// A safetensors file of `(name, shape, dtype, values)`.
    fn write_st(path: &Path, tensors: &[(&str, &[usize], &str, Vec<f32>)]) {
        let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
        for (name, shape, dtype, v) in tensors {
            let start = data.len();
            for &x in v {
                match *dtype {
                    "F32" => data.extend(x.to_le_bytes()),
                    "F16" => data.extend(half::f16::from_f32(x).to_le_bytes()),
                    "BF16" => data.extend(half::bf16::from_f32(x).to_le_bytes()),
                    _ => data.extend([0u8; 3]), // an unknown dtype's bytes (refused before use)
                }
            }
            let info =
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]});
            header.insert(name.to_string(), info);
        }
        let h = Value::Object(header).to_string();
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend(h.as_bytes());
        bytes.extend(data);
        std::fs::write(path, bytes).unwrap();
    }

    const Q0: &str = "base_model.model.model.layers.0.self_attn.q_proj";
    const V1: &str = "base_model.model.model.layers.1.self_attn.v_proj";

    /// A PEFT directory: `adapter_config.json` with `extra` keys, and the tensors.
    fn peft(name: &str, extra: &str, tensors: &[(&str, &[usize], &str, Vec<f32>)]) -> PathBuf {
        let dir = tmp_dir(name);
        let cfg = format!(
            r#"{{"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
            "bias": "none", "use_dora": false, "modules_to_save": null{extra}}}"#
        );
        std::fs::write(dir.join("adapter_config.json"), cfg).unwrap();
        write_st(&dir.join("adapter_model.safetensors"), tensors);
        dir
    }

    /// q_proj of layer 0 at rank 2 (F32); v_proj of layer 1 at rank `rv` (BF16).
    fn q_and_v(rv: usize) -> Vec<(String, Vec<usize>, &'static str, Vec<f32>)> {
        vec![
            (format!("{Q0}.lora_A.weight"), vec![2, 8], "F32", vals(16, -2.0)),
            (format!("{Q0}.lora_B.weight"), vec![8, 2], "F32", vals(16, 1.0)),
            (format!("{V1}.lora_A.weight"), vec![rv, 8], "BF16", vals(rv * 8, 0.5)),
            (format!("{V1}.lora_B.weight"), vec![4, rv], "BF16", vals(4 * rv, -1.0)),
        ]
    }

    fn as_refs<'a>(
        t: &'a [(String, Vec<usize>, &'static str, Vec<f32>)],
    ) -> Vec<(&'a str, &'a [usize], &'a str, Vec<f32>)> {
        t.iter().map(|(n, s, d, v)| (n.as_str(), s.as_slice(), *d, v.clone())).collect()
    }

    fn lora_err(r: Result<LoraAdapter>) -> String {
        match r {
            Err(EngineError::Lora { msg, .. }) => msg,
            Err(other) => panic!("expected a LoRA error, got {other}"),
            Ok(a) => panic!("expected a LoRA error, got adapter {}", a.id),
        }
    }

    #[test]
    fn reads_peft_with_patterns_and_dtypes() {
        let c = config("llama");
        let t = q_and_v(4);
        // v_proj of layer 1 has rank 4 by rank_pattern and alpha 2 by alpha_pattern.
        let extra = r#", "rank_pattern": {"v_proj": 4}, "alpha_pattern": {"layers.1.self_attn.v_proj": 2}"#;
        let dir = peft("patterns", extra, &as_refs(&t));
        let a = load("x", &dir, &c).unwrap();
        assert_eq!(a.name, "x");
        let q = a.weight(LoraTarget { layer: 0, proj: Proj::Q }).unwrap();
        assert_eq!((q.rank, q.scale, &q.a, &q.b), (2, 2.0, &t[0].3, &t[1].3));
        let v = a.weight(LoraTarget { layer: 1, proj: Proj::V }).unwrap();
        assert_eq!((v.rank, v.scale, &v.a, &v.b), (4, 0.5, &t[2].3, &t[3].3));
        assert_eq!(a.weights.len(), 2);

        // rsLoRA: alpha / √r.
        let t = q_and_v(2);
        let dir = peft("rslora", r#", "use_rslora": true"#, &as_refs(&t));
        let a = load("x", &dir, &c).unwrap();
        assert_eq!(a.weights[0].scale, (4.0 / 2f64.sqrt()) as f32);
    }

    #[test]
    fn splits_fused_phi3_modules() {
        let c = config("phi3");
        let qkv = "base_model.model.model.layers.1.self_attn.qkv_proj";
        let gu = "base_model.model.model.layers.0.mlp.gate_up_proj";
        // Q is 8 rows, K and V 4 each; gate and up 12 each.
        let (bq, bg) = (vals(16 * 2, 3.0), vals(24 * 2, -5.0));
        let t = [
            (&*format!("{qkv}.lora_A.weight"), &[2usize, 8][..], "F16", vals(16, 0.0)),
            (&*format!("{qkv}.lora_B.weight"), &[16, 2][..], "F16", bq.clone()),
            (&*format!("{gu}.lora_A.weight"), &[2, 8][..], "F32", vals(16, 1.0)),
            (&*format!("{gu}.lora_B.weight"), &[24, 2][..], "F32", bg.clone()),
        ];
        let dir = peft("phi3", r#", "target_modules": ["qkv_proj", "gate_up_proj"]"#, &t);
        let a = load("x", &dir, &c).unwrap();
        let w = |layer, proj| a.weight(LoraTarget { layer, proj }).unwrap();
        assert_eq!(w(1, Proj::Q).b, bq[..16]);
        assert_eq!(w(1, Proj::K).b, bq[16..24]);
        assert_eq!(w(1, Proj::V).b, bq[24..]);
        for p in [Proj::Q, Proj::K, Proj::V] {
            assert_eq!(w(1, p).a, vals(16, 0.0));
        }
        assert_eq!(w(0, Proj::Gate).b, bg[..24]);
        assert_eq!(w(0, Proj::Up).b, bg[24..]);
        assert_eq!(w(0, Proj::Up).a, vals(16, 1.0));
        assert_eq!(a.weights.len(), 5);

        // A fused B of the wrong height is refused naming the rows.
        let t = [
            (&*format!("{qkv}.lora_A.weight"), &[2usize, 8][..], "F32", vals(16, 0.0)),
            (&*format!("{qkv}.lora_B.weight"), &[12, 2][..], "F32", vals(24, 0.0)),
        ];
        let dir = peft("phi3-bad", r#", "target_modules": ["qkv_proj"]"#, &t);
        let e = lora_err(load("x", &dir, &c));
        assert!(e.contains("qkv_proj of layer 1") && e.contains("12 rows") && e.contains("16"), "{e}");
    }

    #[test]
    fn refuses_missing_files() {
        let c = config("llama");
        let dir = tmp_dir("missing");
        let e = lora_err(load("x", &dir.join("nope"), &c));
        assert!(e.contains("cannot read it"), "{e}");
        let e = lora_err(load("x", &dir, &c));
        assert!(e.contains("no adapter_config.json"), "{e}");
        std::fs::write(dir.join("adapter_config.json"), r#"{"peft_type": "LORA"}"#).unwrap();
        let e = lora_err(load("x", &dir, &c));
        assert!(e.contains("no adapter_model.safetensors in this directory"), "{e}");
        std::fs::write(dir.join("adapter_model.bin"), b"pickle").unwrap();
        let e = lora_err(load("x", &dir, &c));
        assert!(e.contains("only adapter_model.bin"), "{e}");
        let e = lora_err(load("x", &dir.join("adapter_config.json"), &c));
        assert!(e.contains("not one of its files"), "{e}");
        let e = lora_err(load("x", &dir.join("adapter_model.bin"), &c));
        assert!(e.contains("neither a PEFT adapter directory"), "{e}");
        std::fs::write(dir.join("adapter_config.json"), "{not json").unwrap();
        let e = lora_err(load("x", &dir, &c));
        assert!(e.contains("invalid JSON"), "{e}");
    }

    #[test]
    fn refuses_bad_configs() {
        let c = config("llama");
        let t = q_and_v(2);
        for (extra, want) in [
            (r#", "peft_type": "IA3""#, "peft_type is IA3"),
            (r#", "use_dora": true"#, "DoRA"),
            (r#", "bias": "all""#, "bias = \"all\""),
            (r#", "lora_bias": true"#, "lora_bias"),
            (r#", "modules_to_save": ["lm_head"]"#, "modules_to_save"),
            (r#", "trainable_token_indices": [5, 6]"#, "trainable_token_indices"),
            (r#", "target_modules": ["q_proj", "embed_tokens"]"#, "`embed_tokens`"),
            (r#", "target_modules": ["q_proj", "lm_head"]"#, "`lm_head`"),
            (r#", "rank_pattern": {"^model.*q_proj$": 4}"#, "\"^model.*q_proj$\""),
            (r#", "r": 0"#, "r = 0"),
        ] {
            let dir = peft("config", extra, &as_refs(&t));
            let e = lora_err(load("x", &dir, &c));
            assert!(e.contains(want), "{extra}: {e}");
        }
        let dir = peft("no-type", "", &as_refs(&t));
        std::fs::write(dir.join("adapter_config.json"), r#"{"r": 2, "lora_alpha": 4}"#).unwrap();
        let e = lora_err(load("x", &dir, &c));
        assert!(e.contains("no peft_type"), "{e}");
    }

    #[test]
    fn refuses_bad_tensors() {
        let c = config("llama");
        let mut t = q_and_v(2);
        let check = |t: &[(String, Vec<usize>, &'static str, Vec<f32>)], want: &[&str]| {
            let dir = peft("tensors", "", &as_refs(t));
            let e = lora_err(load("x", &dir, &c));
            assert!(want.iter().all(|w| e.contains(w)), "{want:?}: {e}");
        };
        // An adapter for an embedding or lm_head.
        let mut u = t.clone();
        u.push(("base_model.model.lm_head.lora_A.weight".into(), vec![2, 8], "F32", vals(16, 0.0)));
        check(&u, &["module `lm_head`"]);
        let mut u = t.clone();
        u.push((
            "base_model.model.model.embed_tokens.lora_embedding_A".into(),
            vec![2, 16],
            "F32",
            vals(32, 0.0),
        ));
        check(&u, &["model.embed_tokens.lora_embedding_A", "not a LoRA A or B"]);
        let mut u = t.clone();
        let e = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight";
        u.push((e.into(), vec![2, 8], "F32", vals(16, 0.0)));
        check(&u, &["experts.0.gate_proj", "not a projection"]);
        // A without its B.
        check(&t[..3], &["v_proj of layer 1: lora_A has no lora_B"]);
        // Shapes: B of 5 rows for q_proj (8 → 8): LoraAdapter::new names the projection.
        let mut u = t.clone();
        u[1] = (u[1].0.clone(), vec![5, 2], "F32", vals(10, 0.0));
        check(&u, &["q_proj of layer 0", "8 → 8"]);
        // A of rank 2 and B of rank 3.
        let mut u = t.clone();
        u[1] = (u[1].0.clone(), vec![8, 3], "F32", vals(24, 0.0));
        check(&u, &["q_proj of layer 0", "[2, 8]", "[8, 3]"]);
        // The config says r = 2; the weights are rank 4.
        check(&q_and_v(4), &["v_proj of layer 1", "rank 4", "r = 2"]);
        // A layer the base model does not have.
        let mut u = t.clone();
        u[2].0 = u[2].0.replace("layers.1", "layers.7");
        u[3].0 = u[3].0.replace("layers.1", "layers.7");
        check(&u, &["layer 7", "2 layers"]);
        // A dtype it does not read.
        t[0].2 = "I8";
        check(&t, &["dtype I8", "supported: F32, F16, BF16"]);
    }

    #[test]
    fn pattern_keys_match_as_peft_does() {
        let m = "model.layers.1.self_attn.q_proj";
        assert!(pattern_matches("q_proj", m));
        assert!(pattern_matches("layers.1.self_attn.q_proj", m));
        assert!(pattern_matches(m, m));
        assert!(!pattern_matches("layers.1.self_attn.q_proj", "model.layers.11.self_attn.q_proj"));
        assert!(!pattern_matches("proj", m), "the key must start after a dot");
        assert!(!pattern_matches("q_pro", m), "the key must end the name");
        assert!(pattern_matches("self_attn.q.proj", m), "'.' matches any character");
        // The first matching key in file order wins.
        let p: Patterns = serde_json::from_str(
            r#"{"rank_pattern": {"zz.q_proj": 2, "q_proj": 4, "layers.1.self_attn.q_proj": 8}}"#,
        )
        .unwrap();
        assert_eq!(p.rank_pattern.get(m), Some(4.0));
        assert_eq!(p.rank_pattern.get("model.layers.1.self_attn.k_proj"), None);
        let p: Patterns = serde_json::from_str(r#"{"rank_pattern": null, "alpha_pattern": {}}"#).unwrap();
        assert!(p.rank_pattern.0.is_empty() && p.alpha_pattern.0.is_empty());
    }

    /// A GGUF LoRA over `config("llama")`'s shapes: Q of layer 0 (rank 2, its B rows as the file
    /// holds them), K of layer 0, up of layer 1 (F16).
    fn gguf(arch: &str, alpha: Option<f32>, q_b_file: &[f32]) -> Writer {
        let mut w = Writer::new().string("general.architecture", arch).string("general.type", "adapter");
        w = w.string("adapter.type", "lora");
        if let Some(a) = alpha {
            w = w.f32("adapter.lora.alpha", a);
        }
        let f16 =
            |v: &[f32]| v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect::<Vec<u8>>();
        w.tensor("blk.0.attn_q.weight.lora_a", &[8, 2], 0, f32_bytes(&vals(16, 0.0)))
            .tensor("blk.0.attn_q.weight.lora_b", &[2, 8], 0, f32_bytes(q_b_file))
            .tensor("blk.0.attn_k.weight.lora_a", &[8, 2], 0, f32_bytes(&vals(16, 1.0)))
            .tensor("blk.0.attn_k.weight.lora_b", &[2, 4], 0, f32_bytes(&vals(8, 2.0)))
            .tensor("blk.1.ffn_up.weight.lora_a", &[8, 2], 1, f16(&vals(16, -1.0)))
            .tensor("blk.1.ffn_up.weight.lora_b", &[2, 12], 1, f16(&vals(24, -3.0)))
    }

    #[test]
    fn reads_gguf_and_unpermutes_llama_rows() {
        // Q's B in Hugging Face order: row i is [i, 100 + i]. llama.cpp's converter puts HF row
        // (head·4 + 2t + j) at file row (head·4 + 2j + t) (head_dim 4, halves of 2): file rows
        // 0..4 of each head are HF rows 0, 2, 1, 3.
        let hf: Vec<f32> = (0..8).flat_map(|i| [i as f32, 100.0 + i as f32]).collect();
        let order = [0usize, 2, 1, 3, 4, 6, 5, 7];
        let file: Vec<f32> = order.iter().flat_map(|&i| [i as f32, 100.0 + i as f32]).collect();
        let p = write_tmp("lora-llama.gguf", &gguf("llama", Some(4.0), &file).bytes());
        let a = load("g", &p, &config("llama")).unwrap();
        let w = |layer, proj| a.weight(LoraTarget { layer, proj }).unwrap();
        assert_eq!(w(0, Proj::Q).b, hf);
        assert_eq!(w(0, Proj::Q).a, vals(16, 0.0));
        // One KV head of 4: rows (0, 1, 2, 3) in the file are HF rows (0, 2, 1, 3).
        let kb = vals(8, 2.0);
        assert_eq!(w(0, Proj::K).b, [&kb[0..2], &kb[4..6], &kb[2..4], &kb[6..8]].concat());
        assert_eq!((w(1, Proj::Up).b.clone(), w(1, Proj::Up).a.clone()), (vals(24, -3.0), vals(16, -1.0)));
        assert!(a.weights.iter().all(|w| w.scale == 2.0 && w.rank == 2));

        // Qwen2 files are not permuted; without alpha the scale is 1 (llama.cpp's rule).
        let p = write_tmp("lora-qwen2.gguf", &gguf("qwen2", None, &file).bytes());
        let a = load("g", &p, &config("qwen2")).unwrap();
        let q = a.weight(LoraTarget { layer: 0, proj: Proj::Q }).unwrap();
        assert_eq!((&q.b, q.scale), (&file, 1.0));
    }

    #[test]
    fn refuses_bad_gguf() {
        let c = config("llama");
        let file = vals(16, 0.0);
        let check = |w: Writer, name: &str, want: &[&str]| {
            let p = write_tmp(name, &w.bytes());
            let e = lora_err(load("g", &p, &c));
            assert!(want.iter().all(|x| e.contains(x)), "{want:?}: {e}");
        };
        check(gguf("qwen2", Some(4.0), &file), "arch.gguf", &["architecture \"qwen2\"", "Llama"]);
        let model = Writer::new().string("general.architecture", "llama").string("general.type", "model");
        check(model, "model.gguf", &["general.type is \"model\"", "not a LoRA adapter"]);
        check(Writer::new().string("general.architecture", "llama"), "untyped.gguf", &["no general.type"]);
        let cvec = Writer::new().string("general.type", "adapter").string("adapter.type", "cvec");
        check(cvec, "cvec.gguf", &["adapter.type is Some(\"cvec\")"]);
        let embd =
            gguf("llama", Some(4.0), &file).tensor("token_embd.weight.lora_a", &[16, 2], 0, f32_bytes(&file));
        check(embd, "embd.gguf", &["tensor `token_embd.weight.lora_a`"]);
        let lone = gguf("llama", Some(4.0), &file).tensor(
            "blk.1.attn_v.weight.lora_a",
            &[8, 2],
            0,
            f32_bytes(&file),
        );
        check(lone, "lone.gguf", &["blk.1.attn_v: lora_a has no lora_b"]);
        let rank = gguf("llama", Some(4.0), &file)
            .tensor("blk.1.attn_v.weight.lora_a", &[8, 2], 0, f32_bytes(&file))
            .tensor("blk.1.attn_v.weight.lora_b", &[4, 4], 0, f32_bytes(&file));
        check(rank, "rank.gguf", &["blk.1.attn_v: lora_a has rank 2 but lora_b 4"]);
        // B of 6 rows for V (4 rows): LoraAdapter::new names the shape.
        let shape = gguf("llama", Some(4.0), &file)
            .tensor("blk.1.attn_v.weight.lora_a", &[8, 2], 0, f32_bytes(&file))
            .tensor("blk.1.attn_v.weight.lora_b", &[2, 6], 0, f32_bytes(&vals(12, 0.0)));
        check(shape, "shape.gguf", &["v_proj of layer 1", "8 → 4"]);
    }
}
