#!/usr/bin/env python3
"""Writes the dequantization fixtures under engine/tests/data/quant/.

For each GGML type the engine supports, `<type>.bin` holds quantized bytes (whole rows of
blocks) and `<type>.f32` the little-endian f32 values gguf-py dequantizes them to: the values
Hugging Face transformers sees when it loads a GGUF file. The k-quants (Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K) cannot be quantized by gguf-py, so their blocks are random bytes with finite scales. Types
are written in a fixed order from one seeded generator, and types added later come last, so
earlier fixtures are rewritten byte for byte. With the real model present,
`model_rows.json` lists a few rows of its tensors and `model_rows.f32` their dequantized values.

Usage: ~/.venvs/tandem-ref/bin/python tests/reference/make_quant_fixtures.py
"""

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import quants

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "engine" / "tests" / "data" / "quant"
MODEL = Path("/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")
ROWS, COLS = 3, 512
rng = np.random.default_rng(20240611)


KQUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def random_f16(n: int, lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def kquant_blocks(qtype: T, n_blocks: int) -> np.ndarray:
    block_bytes = quants.GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    if qtype in (T.Q4_K, T.Q5_K):
        b[:, 0:2] = random_f16(n_blocks, 1e-4, 0.05)  # d
        b[:, 2:4] = random_f16(n_blocks, 1e-4, 0.05)  # dmin
    elif qtype == T.Q6_K:
        b[:, 208:210] = random_f16(n_blocks, 1e-4, 0.05)  # d (stored last)
    elif qtype == T.Q2_K:
        b[:, 80:82] = random_f16(n_blocks, 1e-4, 0.05)  # d (after scales and quants)
        b[:, 82:84] = random_f16(n_blocks, 1e-4, 0.05)  # dmin
    elif qtype == T.Q3_K:
        b[:, 108:110] = random_f16(n_blocks, 1e-4, 0.05)  # d (stored last)
    return b


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    data = (rng.standard_normal((ROWS, COLS)) * rng.uniform(0.01, 2.0, (ROWS, 1))).astype(np.float32)
    # A few exact zeros and a constant block exercise the d == 0 paths.
    data[0, :32] = 0.0
    data[1, 32:64] = 0.5
    for qtype in [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K,
                  T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K]:
        if qtype in KQUANTS:
            block_len = quants.GGML_QUANT_SIZES[qtype][0]
            q = kquant_blocks(qtype, ROWS * COLS // block_len).reshape(ROWS, -1)
        else:
            q = quants.quantize(data, qtype)
        q = np.ascontiguousarray(q).view(np.uint8).reshape(ROWS, -1)
        deq = quants.dequantize(q, qtype).astype(np.float32, copy=False).reshape(ROWS, COLS)
        (OUT / f"{qtype.name}.bin").write_bytes(q.tobytes())
        (OUT / f"{qtype.name}.f32").write_bytes(deq.astype("<f4").tobytes())
        print(f"{qtype.name}: {q.nbytes} bytes -> {deq.size} values")

    if MODEL.exists():
        reader = GGUFReader(MODEL)
        wanted = {"token_embd.weight": [0, 1, 12345, 49151], "blk.0.attn_q.weight": [0, 575],
                  "blk.29.ffn_down.weight": [7]}
        listing, values = [], []
        for t in reader.tensors:
            if t.name in wanted:
                for r in wanted[t.name]:
                    row = np.ascontiguousarray(t.data[r]).view(np.uint8)
                    values.append(quants.dequantize(row, t.tensor_type).astype(np.float32).ravel())
                    listing.append({"tensor": t.name, "row": r, "len": int(values[-1].size)})
        (OUT / "model_rows.json").write_text(json.dumps({"model": MODEL.name, "rows": listing}, indent=1) + "\n")
        (OUT / "model_rows.f32").write_bytes(np.concatenate(values).astype("<f4").tobytes())
        print(f"model rows: {len(listing)}")
    else:
        print(f"{MODEL} absent: model rows not written")


if __name__ == "__main__":
    main()
