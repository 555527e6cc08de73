#!/usr/bin/env python3
"""Runs `tandem logits` on a model's reference prompts and compares with the reference logits.

A model directory with reference.json + logits files (the tiny fixtures under
tests/reference/fixtures, or what make_qwen3_shaped.py writes) is run prompt by prompt,
teacher-forced on prompt_ids + greedy_ids[:-1], and compared position by position:

  rel. error   ||tandem - reference|| / ||reference|| over all logits of the model
  max abs      largest absolute difference of one logit
  argmax       positions whose argmax equals the reference's, in % of all positions
  decisive     the same over positions whose reference top-2 gap exceeds --gap-factor times the
               rms difference at that position: a near-tie that rounding can flip says nothing
               about correctness, a clear winner must agree
  greedy       continuation positions whose argmax is the reference's greedy token (teacher
               forced, so one flip does not derail the rest)

A reference.json may name several reference logits files ("reference_logits": {"bfloat16": ...,
"float32": ...}); without that key, logits.f32 is a float32 reference. Every one present is
compared; the thresholds apply to --gate-reference (default float32: the exact function of the
stored weights, which a bf16 engine approximates; transformers' own bf16 run is one more
approximation of it, with its own rounding, and is shown for comparison). Exit status 1 when a
model's rel. error exceeds --rel-tol, its decisive argmax agreement is below --argmax-min, or its
greedy agreement is below --greedy-min. Only numpy is needed.

    python3 scripts/gpu/compare_logits.py --tandem target/release/tandem --device cuda:0 \\
        --dtype bf16 tests/reference/fixtures/llama-gqa tests/reference/fixtures/qwen3
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path, help="model directories holding reference.json")
    ap.add_argument("--tandem", default="tandem", help="the tandem binary")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"], help="GPU compute dtype")
    ap.add_argument("--kv-dtype", choices=["f32", "f16", "bf16", "fp8"],
                    help="KV cache dtype (default: the device's, bf16 on a GPU and f16 on the CPU)")
    ap.add_argument("--extra", action="append", default=[],
                    help="one more argument for `tandem logits` (repeat for several)")
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--rel-tol", type=float, default=2e-2)
    ap.add_argument("--argmax-min", type=float, default=0.99, help="fraction of decisive positions")
    ap.add_argument("--greedy-min", type=float, default=0.0, help="fraction of greedy positions")
    ap.add_argument("--gap-factor", type=float, default=4.0)
    ap.add_argument("--gate-reference", default="float32", choices=["float32", "bfloat16"],
                    help="the reference the thresholds apply to, when the model has it")
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    ap.add_argument("--label", default="", help="a name for this run in the table and the JSON")
    return ap.parse_args()


def run_tandem(a, model: Path, ids: list[int], work: Path) -> tuple[np.ndarray, dict]:
    tokens = work / "tokens.json"
    tokens.write_text(json.dumps(ids))
    out = work / "logits.f32"
    cmd = [
        str(a.tandem), "logits", "--model", str(model), "--device", a.device, "--dtype", a.dtype,
        "--tokens-file", str(tokens), "--out", str(out), "--max-batch-tokens", str(a.max_batch_tokens),
        "--dtype-note",
    ] + (["--kv-dtype", a.kv_dtype] if a.kv_dtype else []) + a.extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr.strip()}", file=sys.stderr)
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"tandem logits exited with {p.returncode}: {last}")
    line = json.loads(p.stdout.strip().splitlines()[-1])
    return np.fromfile(out, dtype="<f4"), line


def compare_model(a, model: Path, work: Path) -> dict:
    ref = json.loads((model / "reference.json").read_text())
    vocab = ref["vocab_size"]
    files = ref.get("reference_logits", {"float32": "logits.f32"})
    refs = {k: np.fromfile(model / f, dtype="<f4") for k, f in files.items()}
    gate_ref = a.gate_reference if a.gate_reference in refs else next(iter(refs))

    per_ref = {k: {"sq_err": 0.0, "sq_ref": 0.0, "max_abs": 0.0, "argmax": 0, "decisive": 0,
                   "decisive_agree": 0} for k in refs}
    positions, greedy_total, greedy_agree, seconds, note = 0, 0, 0, 0.0, None
    for p in ref["prompts"]:
        ids = p["prompt_ids"] + p["greedy_ids"][:-1]
        n = p["n_positions"]
        t0 = time.time()
        got, line = run_tandem(a, model, ids, work)
        seconds += time.time() - t0
        note = line.get("dtype")
        got = got.reshape(len(ids), vocab)
        if line["vocab"] != vocab or line["positions"] != len(ids):
            raise RuntimeError(f"{model}: tandem says {line['positions']} × {line['vocab']}")
        # Teacher-forced greedy check: the argmax after position len(prompt) - 1 + i is token i.
        start = len(p["prompt_ids"]) - 1
        g = got[start:].argmax(-1)
        greedy_total += len(g)
        greedy_agree += int((g == np.array(p["greedy_ids"][: len(g)])).sum())
        t = got[:n]
        positions += n
        for k, all_ref in refs.items():
            r = all_ref[p["logits_offset"]: p["logits_offset"] + n * vocab].reshape(n, vocab)
            s = per_ref[k]
            d = t.astype(np.float64) - r
            s["sq_err"] += float((d**2).sum())
            s["sq_ref"] += float((r.astype(np.float64) ** 2).sum())
            s["max_abs"] = max(s["max_abs"], float(np.abs(d).max()))
            same = t.argmax(-1) == r.argmax(-1)
            s["argmax"] += int(same.sum())
            top2 = np.partition(r, -2, axis=-1)[:, -2:]
            gap = np.abs(top2[:, 1] - top2[:, 0])
            rms = np.sqrt((d**2).mean(-1))
            decisive = gap > a.gap_factor * rms
            s["decisive"] += int(decisive.sum())
            s["decisive_agree"] += int((same & decisive).sum())
    result = {"model": model.name, "path": str(model), "device": a.device, "dtype": a.dtype, "kv_dtype": a.kv_dtype,
              "label": a.label, "positions": positions, "gate_reference": gate_ref, "tandem_dtype": note,
              "greedy_positions": greedy_total,
              "greedy_agree": greedy_agree / max(greedy_total, 1), "tandem_seconds": seconds, "references": {}}
    for k, s in per_ref.items():
        result["references"][k] = {
            "rel_err": float(np.sqrt(s["sq_err"] / max(s["sq_ref"], 1e-30))),
            "max_abs": s["max_abs"],
            "argmax_agree": s["argmax"] / positions,
            "decisive_positions": s["decisive"],
            "decisive_agree": s["decisive_agree"] / max(s["decisive"], 1),
        }
    g = result["references"][gate_ref]
    failures = []
    if not g["rel_err"] <= a.rel_tol:
        failures.append(f"rel. error {g['rel_err']:.2e} > {a.rel_tol:.0e}")
    if g["decisive_agree"] < a.argmax_min:
        failures.append(f"decisive argmax {100 * g['decisive_agree']:.2f}% < {100 * a.argmax_min:.0f}%")
    if result["greedy_agree"] < a.greedy_min:
        failures.append(f"greedy {100 * result['greedy_agree']:.2f}% < {100 * a.greedy_min:.0f}%")
    result["failures"] = failures
    result["ok"] = not failures
    return result


def main() -> int:
    a = parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="tandem-logits-") as tmp:
        for m in a.models:
            try:
                results.append(compare_model(a, m, Path(tmp)))
            except Exception as e:  # one broken model must not hide the others' results
                msg = " ".join(str(e).split()).replace("|", "/")
                results.append({"model": m.name, "path": str(m), "device": a.device, "dtype": a.dtype,
                                "kv_dtype": a.kv_dtype,
                                "label": a.label, "ok": False, "failures": [msg], "references": {}})
    title = (f"logits parity: tandem {a.device} {a.dtype}" + (f", {a.kv_dtype} KV" if a.kv_dtype else "")
             + (f" ({a.label})" if a.label else ""))
    print(title)
    print("| model | reference | positions | rel. error | max abs | argmax | decisive | greedy | ok |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        if not r["references"]:
            print(f"| {r['model']} | - | - | - | - | - | - | - | FAIL: {'; '.join(r['failures'])} |")
            continue
        for k, s in r["references"].items():
            gated = k == r["gate_reference"]
            ok = ("ok" if r["ok"] else "FAIL: " + "; ".join(r["failures"])) if gated else "(info)"
            print(
                f"| {r['model']} | {k} | {r['positions']} | {s['rel_err']:.2e} | {s['max_abs']:.2e} | "
                f"{100 * s['argmax_agree']:.2f}% | {100 * s['decisive_agree']:.2f}% of {s['decisive_positions']} | "
                f"{100 * r['greedy_agree']:.1f}% of {r['greedy_positions']} | {ok} |"
            )
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
