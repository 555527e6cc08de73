#!/usr/bin/env python3
"""Writes the FP8 checkpoint fixture and its dequantized twin from the tiny Qwen3 fixture.

tests/reference/fixtures/qwen3-fp8: every projection weight (`*_proj.weight`) as fp8 E4M3
(`F8_E4M3`) with one f32 scale per block of 48 x 40 weights (`weight_scale_inv`, blocks that do
not divide the matrices), as `quant_method: "fp8"` checkpoints store them; the rest as in the
source (F16). tests/reference/fixtures/qwen3-fp8-twin: the same model with those weights dequantized
to F32 (each code's value times its block's scale, one f32 product), and no quantization_config.
The engine must load the two to the same values bit for bit.

Standard library only; deterministic. Run from the repository root:
    python3 scripts/make_fp8_fixture.py
"""
import json
import math
import shutil
import struct
from pathlib import Path

SRC = Path("tests/reference/fixtures/qwen3")
FP8 = Path("tests/reference/fixtures/qwen3-fp8")
TWIN = Path("tests/reference/fixtures/qwen3-fp8-twin")
BLOCK = (48, 40)
FP8_MAX = 448.0


def f32(x):
    """x rounded to float32."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def fp8_bits(x):
    """float32 -> fp8 E4M3 code: round to nearest, ties to even, saturating at 448 (the engine's
    `fp8_bits`, step for step)."""
    b = f32_bits(x)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7F
    if a >= 0x43E00000:
        return sign | 0x7E
    if a < 0x3C800000:
        v = struct.unpack("<f", struct.pack("<I", a))[0] * 512.0
        return sign | int(round(v))  # Python rounds half to even
    r = a + 0x7FFFF + ((a >> 20) & 1)
    e = (r >> 23) - 120
    return sign | ((e << 3) & 0xFF) | ((r >> 20) & 7)


def fp8_value(c):
    e, m = (c >> 3) & 15, c & 7
    mag = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if c & 0x80 else mag


def read(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        raw = body[s:e]
        assert info["dtype"] == "F16", f"{name}: the twin keeps the source's F16 values exactly; got {info['dtype']}"
        fmt = "e"
        count = math.prod(info["shape"])
        vals = list(struct.unpack(f"<{count}{fmt}", raw))
        out[name] = (info["shape"], [f32(v) for v in vals])
    return out


def write(path, tensors):
    """tensors: name -> (dtype, shape, bytes); written in name order."""
    header, body = {}, b""
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def quantize(shape, vals):
    rows, cols = shape
    br, bc = BLOCK
    grid = (-(-rows // br), -(-cols // bc))
    scales = []
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax = max(
                abs(vals[r * cols + c])
                for r in range(i * br, min(rows, (i + 1) * br))
                for c in range(j * bc, min(cols, (j + 1) * bc))
            )
            scales.append(f32(amax / FP8_MAX) if amax > 0 else 1.0)
    codes, deq = bytearray(), []
    for r in range(rows):
        for c in range(cols):
            s = scales[(r // br) * grid[1] + c // bc]
            code = fp8_bits(f32(vals[r * cols + c] / s))
            codes.append(code)
            deq.append(f32(fp8_value(code) * s))
    return bytes(codes), list(grid), scales, deq


def main():
    src = read(SRC / "model.safetensors")
    fp8, twin = {}, {}
    for name, (shape, vals) in src.items():
        if name.endswith("_proj.weight"):
            codes, grid, scales, deq = quantize(shape, vals)
            fp8[name] = ("F8_E4M3", shape, codes)
            fp8[name + "_scale_inv"] = ("F32", grid, struct.pack(f"<{len(scales)}f", *scales))
            twin[name] = ("F32", shape, struct.pack(f"<{len(deq)}f", *deq))
        else:
            raw = struct.pack(f"<{len(vals)}e", *vals)  # the source's F16 values, exactly
            fp8[name] = twin[name] = ("F16", shape, raw)
    config = json.loads((SRC / "config.json").read_text())
    for out, tensors, quant in [(FP8, fp8, True), (TWIN, twin, False)]:
        out.mkdir(parents=True, exist_ok=True)
        for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]:
            if (SRC / f).exists():
                shutil.copy(SRC / f, out / f)
        c = dict(config)
        c.pop("dtype", None)
        if quant:
            c["quantization_config"] = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK),
            }
        (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
        write(out / "model.safetensors", tensors)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
