#!/usr/bin/env python3
"""Prints the GPU check's table (markdown) from the result files scripts/gpu-check.sh leaves in
one directory, and writes all of them combined into results.json there.

    python3 scripts/gpu/summary.py target/gpu-check/out

It reads every stages*.tsv there (one per stage run), so the results of separate device calls
merge into one table.
"""

import json
import sys
import time
from pathlib import Path


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def num(x, fmt):
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def main() -> int:
    d = Path(sys.argv[1])
    gpu = (d / "gpu.txt").read_text().strip() if (d / "gpu.txt").exists() else "unknown"
    # One file of rows per stage run (stages-tests.tsv, stages-parity.tsv, ...): the calls of a
    # session add up. A step run again by a later call replaces its earlier row.
    rows = {}
    for f in sorted(d.glob("stages*.tsv"), key=lambda f: f.stat().st_mtime):
        for line in f.read_text().splitlines():
            name, status, secs = (line.split("\t") + ["", "", ""])[:3]
            rows.pop(name, None)
            rows[name] = {"stage": name, "result": status, "seconds": int(secs or 0)}
    stages = list(rows.values())
    parity = []
    for name in ["tiny-f32", "tiny-bf16", "tiny-bf16-kvf32", "tiny-bf16-kvfp8", "qwen3-bf16", "qwen3-f32"]:
        parity += load(d / f"parity-{name}.json") or []
    qref = load(d / "qwen3-shaped-reference.json")
    hf = load(d / "hf-bench.json")
    tb = load(d / "tandem-bench.json")
    (d / "results.json").write_text(
        json.dumps({"gpu": gpu, "stages": stages, "parity": parity, "qwen3_shaped_reference_note":
                    (qref or {}).get("note"), "transformers": hf, "tandem": tb}, indent=1) + "\n"
    )

    out = []
    p = out.append
    p(f"# GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    p("")
    p(f"GPU: {gpu}")
    p("")
    p("| stage | result | seconds |")
    p("|---|---|---:|")
    for s in stages:
        p(f"| {s['stage']} | {s['result']} | {s['seconds']} |")
    p("")

    if parity:
        p("## Logits: tandem vs transformers")
        p("")
        p("rel. error = ‖tandem − ref‖ / ‖ref‖ over all logits; decisive = argmax agreement where the "
          "reference's top-2 gap exceeds 4× that position's rms difference; greedy = teacher-forced "
          "agreement with the reference's greedy tokens.")
        p("")
        p("| model | tandem | reference | positions | rel. error | argmax | decisive | greedy | gate |")
        p("|---|---|---|---:|---:|---:|---:|---:|---|")
        for r in parity:
            if not r.get("references"):
                p(f"| {r['model']} | {r['dtype']} | - | - | - | - | - | - | FAIL: {'; '.join(r['failures'])} |")
                continue
            for k, s in r["references"].items():
                gated = k == r.get("gate_reference")
                gate = ("ok" if r["ok"] else "FAIL: " + "; ".join(r["failures"])) if gated else "info"
                kv = f", {r['kv_dtype']} KV" if r.get("kv_dtype") else ""
                p(f"| {r['model']} | {r['device']} {r['dtype']}{kv} | transformers {k} | {r['positions']} | "
                  f"{s['rel_err']:.1e} | {100 * s['argmax_agree']:.1f}% | "
                  f"{100 * s['decisive_agree']:.1f}% of {s['decisive_positions']} | "
                  f"{100 * r['greedy_agree']:.1f}% | {gate} |")
        if qref:
            p("")
            p(f"qwen3-shaped reference: {qref.get('note')} ({qref.get('device')}, torch {qref.get('torch')}, "
              f"transformers {qref.get('transformers')}).")
        p("")

    if tb or hf:
        p("## Speed: random-weight Qwen3-0.6B-shaped model" + (f", tandem {tb['compute_dtype']}" if tb else ""))
        p("")
        if tb:
            tr = tb.get("traffic_bytes_per_s")
            p(f"tandem {tb['device']}: weights read per decode step {tb['weight_bytes_per_step'] / 1e6:.0f} MB "
              f"({tb['weight_storage']}), KV {tb.get('kv_dtype', '')} {tb['kv_elem_bytes']} bytes per element, "
              f"context {tb['context']}; "
              f"memory traffic {num(tr and tr / 1e9, '.0f')} GB/s read + written "
              f"({tb.get('bandwidth_source')}; twice the copy bandwidth).")
        if hf:
            p(f"transformers {hf['transformers']} (torch {hf['torch']}, {hf['dtype']}, {hf['attn_implementation']}) "
              f"on {hf['device']}: {hf['dtype']} matmul {num(hf.get('matmul_tflops'), '.4g')} TFLOP/s at "
              f"{hf.get('matmul_size')}³; copy {num(hf.get('copy_bytes_per_s') and hf['copy_bytes_per_s'] / 1e9, '.0f')} GB/s.")
        p("")
        p("| decode batch | tandem tokens/s | tandem ms/step | bound tokens/s | tandem × bound | "
          "transformers tokens/s | tandem / transformers | tandem kernels/layer |")
        p("|---:|---:|---:|---:|---:|---:|---:|---:|")
        t_rows = {r["batch"]: r for r in (tb or {}).get("decode", [])}
        h_rows = {r["batch"]: r for r in (hf or {}).get("decode", [])}
        for b in sorted(set(t_rows) | set(h_rows)):
            t, h = t_rows.get(b, {}), h_rows.get(b, {})
            ratio = t["tokens_per_s"] / h["tokens_per_s"] if t and h else None
            p(f"| {b} | {num(t.get('tokens_per_s'), '.0f')} | {num(t.get('ms_per_step'), '.2f')} | "
              f"{num(t.get('bound_tokens_per_s'), '.0f')} | {num(t.get('times_bound'), '.2f')} | "
              f"{num(h.get('tokens_per_s'), '.0f')} | {num(ratio, '.2f')} | {num(t.get('kernels_per_layer'), '.1f')} |")
        by_kv = [(name, load(d / f"tandem-bench-kv-{name}.json")) for name in ["f32", "fp8"]]
        by_kv = [(name, {r["batch"]: r for r in b.get("decode", [])}) for name, b in by_kv if b]
        if by_kv and t_rows:
            main_kv = (tb or {}).get("kv_dtype") or f"{(tb or {}).get('kv_elem_bytes')}-byte"
            p("")
            p("Decode by KV dtype, same run (ms per step; the table above is the " + main_kv + " KV):")
            p("")
            names = [main_kv] + [n for n, _ in by_kv]
            p("| decode batch | " + " | ".join(f"{n} KV ms/step" for n in names) + " |")
            p("|---:|" + "---:|" * len(names))
            for b in sorted(t_rows):
                cells = [num(t_rows[b].get("ms_per_step"), ".2f")]
                cells += [num(rows.get(b, {}).get("ms_per_step"), ".2f") for _, rows in by_kv]
                p(f"| {b} | " + " | ".join(cells) + " |")
        variants = [("cuBLAS products (`--no-decode-gemv`)", "tandem-bench-cublas.json"),
                    ("no PDL (`--no-pdl`)", "tandem-bench-nopdl.json")]
        variants = [(label, {r["batch"]: r for r in (load(d / f) or {}).get("decode", [])}) for label, f in variants]
        variants = [(label, rows) for label, rows in variants if rows]
        if variants and t_rows:
            p("")
            p("Decode variants, same run, against the default (the table above):")
            p("")
            p("| variant | decode batch | default ms/step | variant ms/step | default kernels/layer | "
              "variant kernels/layer |")
            p("|---|---:|---:|---:|---:|---:|")
            for label, rows in variants:
                for b in sorted(rows):
                    o, c = t_rows.get(b, {}), rows[b]
                    p(f"| {label} | {b} | {num(o.get('ms_per_step'), '.3f')} | {num(c.get('ms_per_step'), '.3f')} | "
                      f"{num(o.get('kernels_per_layer'), '.1f')} | {num(c.get('kernels_per_layer'), '.1f')} |")
        dev_s = {r["batch"]: r for r in (load(d / "tandem-bench-sampled.json") or {}).get("decode", [])}
        host_s = {r["batch"]: r for r in (load(d / "tandem-bench-hostsampled.json") or {}).get("decode", [])}
        if dev_s or host_s:
            p("")
            p("Sampled decode (temperature 1, top-p 0.9), same run: drawn on the device against logits rows "
              "copied to the host sampler (`--no-device-sampling`):")
            p("")
            p("| decode batch | greedy ms/step | device-sampled ms/step | host-sampled ms/step |")
            p("|---:|---:|---:|---:|")
            for b in sorted(set(dev_s) | set(host_s)):
                p(f"| {b} | {num(t_rows.get(b, {}).get('ms_per_step'), '.3f')} | "
                  f"{num(dev_s.get(b, {}).get('ms_per_step'), '.3f')} | {num(host_s.get(b, {}).get('ms_per_step'), '.3f')} |")
        tp = (tb or {}).get("prefill") or {}
        hp = (hf or {}).get("prefill") or {}
        if tp or hp:
            p("")
            p(f"| prefill ({tp.get('tokens') or hp.get('tokens')} tokens) | tokens/s | seconds | matmul TFLOP/s | "
              "bound tokens/s | × bound |")
            p("|---|---:|---:|---:|---:|---:|")
            p(f"| tandem | {num(tp.get('tokens_per_s'), '.0f')} | {num(tp.get('seconds'), '.4f')} | "
              f"{num(tp.get('achieved_tflops'), '.4g')} | {num(tp.get('bound_tokens_per_s'), '.0f')} | "
              f"{num(tp.get('times_bound'), '.2f')} |")
            for name, label in [("tandem-bench-cudacores.json", "tandem, CUDA-core attention"),
                                ("tandem-bench-splitk.json", "tandem, split-K attention")]:
                sk = (load(d / name) or {}).get("prefill") or {}
                if sk:
                    p(f"| {label} | {num(sk.get('tokens_per_s'), '.0f')} | "
                      f"{num(sk.get('seconds'), '.4f')} | {num(sk.get('achieved_tflops'), '.4g')} | "
                      f"{num(sk.get('bound_tokens_per_s'), '.0f')} | {num(sk.get('times_bound'), '.2f')} |")
            p(f"| transformers | {num(hp.get('tokens_per_s'), '.0f')} | {num(hp.get('seconds'), '.4f')} | - | - | - |")
        p("")
    cluster = []
    if (d / "cluster-bench.jsonl").exists():
        for line in (d / "cluster-bench.jsonl").read_text().splitlines():
            try:
                cluster.append(json.loads(line))
            except ValueError:
                pass
    if cluster:
        p("## Disaggregated cluster: `tandem up` over cuda-ipc, `tandem bench --router`")
        p("")
        p("Qwen3-shaped body (28 layers, hidden 1024) with a 448-token vocabulary, random weights, bf16; "
          "prefill and decode worker on the same GPU; synthetic prompts, ignore_eos.")
        p("")
        p("| concurrency | requests | prompt | output | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
          "output tok/s | failed |")
        p("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in cluster:
            t, i = r.get("ttft_ms", {}), r.get("itl_ms", {})
            p(f"| {r.get('concurrency')} | {r.get('requests')} | {r.get('prompt_tokens', '-')} | "
              f"{r.get('decode_tokens', r.get('output_tokens', '-'))} | {num(t.get('p50'), '.1f')} | "
              f"{num(t.get('p99'), '.1f')} | {num(i.get('p50'), '.2f')} | {num(i.get('p99'), '.2f')} | "
              f"{num(r.get('output_tokens_per_s'), '.0f')} | {r.get('failed')} |")
        p("")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
