#!/usr/bin/env python3
"""Builds Tandem's LoRA adapter fixtures with transformers + PEFT, over the tiny reference models
that make_fixtures.py wrote (run that first if tests/reference/fixtures/<model>/ is missing).

Outputs, under tests/reference/fixtures/lora/:
  <model>/<adapter>/  a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
                      plus reference.json (prompt ids, greedy ids under the adapter) and
                      logits.f32 (all-position float32 logits under the adapter, little endian),
                      in the layout of the base fixtures (fixture_reader.rs reads both)
  llama-gqa/b.gguf    adapter b as a llama.cpp GGUF LoRA file (convert_lora_to_gguf.py's layout)

PEFT initialises lora_B to zero, which would make every adapter a no-op: every lora_A / lora_B
is set from a seeded normal instead, scaled so that each adapter moves the logits clearly (the
greedy tokens change) while they stay of the base model's size. The reference numbers come from
the files as written: the base model is loaded again from its fixture and the adapter with
PeftModel.from_pretrained, as the engine sees them.

Everything is seeded, so running it twice gives the same files (with the library versions
listed in README.md). Run with the reference venv:

    ~/.venvs/tandem-ref/bin/python tests/reference/make_lora_fixtures.py
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_fixtures import FIXTURES, seed_everything  # noqa: E402

import gguf  # noqa: E402

OUT = FIXTURES / "lora"
# Prompts taken from each base fixture's reference.json, by text: both longer than
# cpu::matmul::SMALL_N (8) tokens, the second longer than Gemma 3's 16-token window.
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return a + b\nprint(add(2, 3))"]
N_NEW = 16
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name, base fixture, LoRA config, seed, std of B relative to 1/sqrt(rank) (see `randomize`),
# dtype the tensors are stored in (the engine reads F32, F16 and BF16).
ADAPTERS = [
    dict(name="a", base="llama-gqa", seed=1,
         cfg=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
         b_std=0.3, dtype=torch.float32),
    dict(name="b", base="llama-gqa", seed=2,
         cfg=dict(r=8, lora_alpha=16, target_modules=ALL7, use_rslora=True),
         b_std=0.1, dtype=torch.float32, gguf=True),
    dict(name="c", base="llama-gqa", seed=3,
         cfg=dict(r=16, lora_alpha=16, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]),
         b_std=0.3, dtype=torch.bfloat16),
    dict(name="a", base="phi3", seed=4,
         cfg=dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"]),
         b_std=0.15, dtype=torch.float16),
    dict(name="a", base="gemma3", seed=5,
         cfg=dict(r=4, lora_alpha=8, target_modules=ALL7),
         b_std=0.1, dtype=torch.bfloat16),
]


def greedy_reference(model, ids: list[int], n_new: int) -> tuple[list[int], float]:
    """Greedy continuation via model.generate (do_sample False, no stop token: the base
    fixtures' generation_config.json names EOS 2, which an adapter may well produce), checked
    against a plain argmax loop over full forward passes; and the smallest top-2 logit gap on
    the way."""
    input_ids = torch.tensor([ids], dtype=torch.long)
    # generate() fills unset fields from the model's own generation config: clear its EOS there.
    model.get_base_model().generation_config.eos_token_id = None
    gen_cfg = GenerationConfig(
        do_sample=False, max_new_tokens=n_new, min_new_tokens=0, eos_token_id=None, pad_token_id=0,
        bos_token_id=None,
    )
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=gen_cfg)
    new = out[0, len(ids):].tolist()
    assert len(new) == n_new, f"generation stopped early: {new}"
    seq = list(ids)
    min_gap = float("inf")
    with torch.no_grad():
        for step in range(n_new):
            logits = model(torch.tensor([seq])).logits[0, -1]
            nxt = int(torch.argmax(logits))
            assert nxt == new[step], f"generate and argmax loop disagree at step {step}"
            top2 = torch.topk(logits, 2).values
            min_gap = min(min_gap, float(top2[0] - top2[1]))
            seq.append(nxt)
    return new, min_gap


def load_base(base: str):
    ref = json.loads((FIXTURES / base / "reference.json").read_text())
    kw = {"attn_implementation": ref["attn_implementation"]} if ref.get("attn_implementation") else {}
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / base, dtype=torch.float32, **kw)
    model.eval()
    return model, ref


def randomize(model, seed: int, b_std: float, dtype) -> None:
    """Sets every lora_A / lora_B weight (in name order) from a seeded normal: A with std
    1/sqrt(in) (so x·Aᵀ has entries of the size of x's), B with std b_std/sqrt(rank) times the
    scale's inverse (so the delta's size does not depend on alpha, rank or rsLoRA). Values are
    rounded to `dtype` so the file stores them exactly."""
    g = torch.Generator().manual_seed(seed)
    named = dict(model.named_modules())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name:
                fan_in = p.shape[1]
                v = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
            elif ".lora_B." in name:
                layer = named[name.rsplit(".lora_B.", 1)[0]]
                scale = layer.scaling["default"]
                rank = p.shape[1]
                v = torch.randn(p.shape, generator=g) * b_std / math.sqrt(rank) / scale
            else:
                continue
            p.copy_(v.to(dtype).to(torch.float32))


def store_as(path: Path, dtype) -> None:
    """Rewrites a safetensors file with its tensors in `dtype` (values already representable)."""
    if dtype == torch.float32:
        return
    tensors = load_file(path)
    out = {}
    for k, v in tensors.items():
        w = v.to(dtype)
        assert torch.equal(w.to(torch.float32), v), f"{k} is not exact in {dtype}"
        out[k] = w.contiguous()
    save_file(out, path, metadata={"format": "pt"})
    path.chmod(0o644)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute over the rows of `w` (rows = n_head · head_dim):
    the rotary halves of each head interleaved. On a LoRA pair the converter applies it to B
    only (LoraTorchTensor.reshape/permute act on B's rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def write_gguf(adapter_dir: Path, base_cfg: dict, path: Path) -> None:
    """The adapter as convert_lora_to_gguf.py lays it out for a Llama base: general.type adapter,
    adapter.type lora, adapter.lora.alpha; `blk.N.<name>.weight.lora_a` = A (numpy r × in, GGML
    dims [in, r]) and `.lora_b` = B (out × r, dims [r, out]), Q and K's B rows permuted as the
    base weights are. f32 tensors.

    llama.cpp scales a delta by alpha / rank and knows nothing of rsLoRA (the converter copies
    lora_alpha as it is), so an rsLoRA adapter is written with the alpha that gives PEFT's scale
    under llama.cpp's rule: rank · f32(lora_alpha / √rank), exact in f32 for rank 8."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r, alpha = cfg["r"], float(cfg["lora_alpha"])
    assert not cfg.get("rank_pattern") and not cfg.get("alpha_pattern")
    if cfg.get("use_rslora"):
        alpha = float(np.float32(alpha / math.sqrt(r))) * r
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    n_head, n_kv = base_cfg["num_attention_heads"], base_cfg["num_key_value_heads"]
    for layer in range(base_cfg["num_hidden_layers"]):
        for mod in ALL7:
            part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            a = tensors[f"{key}.lora_A.weight"].to(torch.float32).numpy()
            b = tensors[f"{key}.lora_B.weight"].to(torch.float32).numpy()
            if mod == "q_proj":
                b = llama_permute(b, n_head)
            elif mod == "k_proj":
                b = llama_permute(b, n_kv)
            name = f"blk.{layer}.{GGUF_NAMES[mod]}.weight"
            w.add_tensor(name + ".lora_a", np.ascontiguousarray(a, dtype=np.float32))
            w.add_tensor(name + ".lora_b", np.ascontiguousarray(b, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(spec: dict) -> str:
    base, name = spec["base"], spec["name"]
    out = OUT / base / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    seed_everything(3000 + spec["seed"])

    model, base_ref = load_base(base)
    cfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec["cfg"])
    peft_model = get_peft_model(model, cfg)
    randomize(peft_model, 4000 + spec["seed"], spec["b_std"], spec["dtype"])
    peft_model.save_pretrained(out, safe_serialization=True)
    # The model card is a template with library versions: not needed.
    (out / "README.md").unlink(missing_ok=True)
    (out / "adapter_model.safetensors").chmod(0o644)
    store_as(out / "adapter_model.safetensors", spec["dtype"])
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    # An absolute local path would differ between machines; the engine does not read it.
    adapter_cfg["base_model_name_or_path"] = f"tests/reference/fixtures/{base}"
    # PEFT keeps target_modules as a set: its order in the file would change from run to run.
    adapter_cfg["target_modules"] = sorted(adapter_cfg["target_modules"])
    (out / "adapter_config.json").write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")
    del peft_model, model

    # The reference: the files as written, loaded again.
    base_model, _ = load_base(base)
    model = PeftModel.from_pretrained(base_model, out)
    model.eval()
    tok = AutoTokenizer.from_pretrained(FIXTURES / base)
    by_text = {p["text"]: p for p in base_ref["prompts"]}
    records, blobs, offset = [], [], 0
    min_gap = float("inf")
    max_delta, changed = 0.0, 0
    base_logits = np.fromfile(FIXTURES / base / "logits.f32", dtype="<f4")
    vocab = base_ref["vocab_size"]
    for text in PROMPTS:
        bp = by_text[text]
        ids = bp["prompt_ids"]
        assert tok(text)["input_ids"] == ids, f"{base}: tokenizer disagrees with its fixture"
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].to(torch.float32).numpy()
        greedy, gap = greedy_reference(model, ids, N_NEW)
        min_gap = min(min_gap, gap)
        b0 = bp["logits_offset"]
        before = base_logits[b0:b0 + len(ids) * vocab].reshape(len(ids), vocab)
        max_delta = max(max_delta, float(np.abs(logits - before).max()))
        changed += sum(int(x != y) for x, y in zip(greedy, bp["greedy_ids"]))
        records.append(
            {
                "text": text,
                "prompt_ids": ids,
                "logits_offset": offset,
                "n_positions": len(ids),
                "greedy_ids": greedy,
                "greedy_text": tok.decode(greedy),
                "stopped_at_eos": False,
                "greedy_min_top2_gap": gap,
            }
        )
        blobs.append(np.ascontiguousarray(logits, dtype="<f4").tobytes())
        offset += logits.size
    ref = {
        "model": f"{base} + lora {name}",
        "base": base,
        "adapter": name,
        "vocab_size": vocab,
        "lora_config": spec["cfg"],
        "stored_dtype": str(spec["dtype"]).replace("torch.", ""),
        "greedy_min_top2_gap": min_gap,
        "max_abs_logit_change_from_base": max_delta,
        "greedy_tokens_changed_from_base": changed,
        "prompts": records,
    }
    (out / "reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    (out / "logits.f32").write_bytes(b"".join(blobs))
    assert changed > 0, f"{base}/{name}: the adapter does not change the greedy tokens"
    if spec.get("gguf"):
        base_cfg = json.loads((FIXTURES / base / "config.json").read_text())
        write_gguf(out, base_cfg, OUT / base / f"{name}.gguf")
    size = sum(f.stat().st_size for f in out.iterdir())
    return (
        f"{base}/{name}: {size / 1024:.0f} KiB, logits move by up to {max_delta:.3f}, "
        f"{changed} of {N_NEW * len(PROMPTS)} greedy tokens change, min top-2 gap {min_gap:.4f}"
    )


def main() -> int:
    torch.set_num_threads(2)
    for spec in ADAPTERS:
        if not (FIXTURES / spec["base"] / "config.json").exists():
            print(f"{spec['base']}: no base fixture, skipped (run make_fixtures.py)", flush=True)
            continue
        print(build(spec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
