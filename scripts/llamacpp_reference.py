#!/usr/bin/env python3
"""Driver of scripts/llamacpp-reference.sh: asks a running llama-server (and llama-tokenize) for
reference outputs of one GGUF model and writes them as JSON.

Only the standard library is needed for the llama.cpp part. When transformers (with torch and
gguf) can be imported, the same GGUF is also read with transformers' GGUF loader and its
tokenization and greedy continuations are recorded next to llama.cpp's, with the disagreements.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

TOKENIZER_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "several   spaces    between     words",
    "  two leading spaces and trailing ones  ",
    "line one\nline two\n\n\nline five\n",
    "\ttab\tseparated\tvalues",
    "digits 12345 and 3.14159, the year 2024, 1000000",
    "Grüße aus Köln, café, naïve",
    "日本語のテキストです",
    "emoji 😀👍🏽 and 🎉",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "literal <bos> and <eos> markers in text",
    "",
]

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."},
        {"role": "user", "content": "Now one about mountains."},
    ],
]

N_PREDICT = 32
N_PROBS = 5


def log(msg: str) -> None:
    print(f"llamacpp_reference: {msg}", file=sys.stderr, flush=True)


def long_prompt() -> str:
    """More than 512 tokens, Gemma 3 270M's sliding window, so the window must be honoured."""
    return "Counting in words and digits: " + ", ".join(f"{i} ({i * 7 % 10})" for i in range(1, 121)) + ","


class Server:
    def __init__(self, url: str, pid: int | None):
        self.url = url.rstrip("/")
        self.pid = pid

    def call(self, path: str, body=None, timeout: float = 600.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode())

    def wait_ready(self, timeout: float = 300.0) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.pid is not None:
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    sys.exit("llamacpp_reference: llama-server exited before it was ready")
            try:
                if self.call("/health", timeout=5).get("status") == "ok":
                    return
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                pass
            time.sleep(0.5)
        sys.exit(f"llamacpp_reference: llama-server not ready after {timeout:.0f} s")

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True):
        r = self.call("/tokenize", {"content": text, "add_special": add_special,
                                    "parse_special": parse_special, "with_pieces": True})
        ids = [t["id"] for t in r["tokens"]]
        pieces = [t["piece"] for t in r["tokens"]]
        return ids, pieces

    def detokenize(self, ids):
        return self.call("/detokenize", {"tokens": ids})["content"]


def llama_tokenize(binary: str, model: str, text: str, add_bos: bool) -> list[int]:
    """llama-tokenize on the exact bytes of `text` (from a file, escapes off), special tokens
    parsed (its default), as the server's /tokenize does by default."""
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode())
        path = f.name
    try:
        cmd = [binary, "-m", model, "-f", path, "--no-escape", "--ids", "--log-disable"]
        if not add_bos:
            cmd.append("--no-bos")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    line = [ln for ln in out.splitlines() if ln.startswith("[")]
    if len(line) != 1:
        sys.exit(f"llamacpp_reference: unexpected llama-tokenize output: {out!r}")
    return json.loads(line[-1])


def complete(server: Server, prompt_ids: list[int], eog_ids: set[int]):
    """Greedy continuation of `prompt_ids` (passed as ids, so nothing is added). Generation stops
    at an end-of-generation token, which is then the last id, or after N_PREDICT tokens."""
    body = {
        "prompt": prompt_ids,
        "n_predict": N_PREDICT,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k", "temperature"],
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "dry_multiplier": 0.0,
        "seed": 0,
        "cache_prompt": False,
        "n_probs": N_PROBS,
        "post_sampling_probs": False,
        "return_tokens": True,
        "stream": False,
    }
    r = server.call("/completion", body)
    ids = r["tokens"]
    steps = r["completion_probabilities"]
    if len(steps) != len(ids) or any(s["id"] != i for s, i in zip(steps, ids)):
        sys.exit(f"llamacpp_reference: tokens and completion_probabilities disagree: {ids} / {steps}")
    if r["tokens_evaluated"] != len(prompt_ids):
        sys.exit(f"llamacpp_reference: server evaluated {r['tokens_evaluated']} prompt tokens, sent {len(prompt_ids)}")
    top5 = [[[t["id"], round(t["logprob"], 5)] for t in s["top_logprobs"]] for s in steps]
    for step, (i, top) in enumerate(zip(ids, top5)):
        if top[0][0] != i:
            sys.exit(f"llamacpp_reference: step {step}: greedy token {i} is not the top one {top}")
    gaps = [top[0][1] - top[1][1] for top in top5 if len(top) > 1]
    stopped = bool(ids) and ids[-1] in eog_ids
    return {
        "greedy_ids": ids,
        "greedy_text": r["content"],
        "stopped_at_eos": stopped,
        "stop_type": r.get("stop_type"),
        "top5_logprobs": top5,
        "greedy_min_top2_logprob_gap": round(min(gaps), 5) if gaps else None,
    }


# --------------------------------------------------------------------------------------------
# transformers, second opinion
# --------------------------------------------------------------------------------------------


def transformers_opinion(model_path: str, record: dict) -> dict | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        import transformers
    except ImportError as e:
        log(f"no transformers here ({e}); skipping the second opinion")
        return None
    d, f = os.path.dirname(model_path), os.path.basename(model_path)
    log("transformers: loading the GGUF tokenizer")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    out = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
        "has_chat_template": bool(tok.chat_template),
    }
    disagreements = []
    for case in record["tokenizer_cases"]:
        for key, add in (("ids_with_bos", True), ("ids_no_bos", False)):
            hf = tok(case["text"], add_special_tokens=add)["input_ids"]
            if hf != case[key]:
                case.setdefault("transformers", {})[key] = hf
                disagreements.append({"text": case["text"], "which": key, "llama_cpp": case[key],
                                      "transformers": hf})
    out["tokenizer_disagreements"] = disagreements
    log(f"transformers: {len(disagreements)} tokenization disagreements")

    # The same template rendered by transformers (Jinja2). llama.cpp drops a leading BOS string
    # from the rendering because tokenization adds the BOS token.
    chat_disagreements = []
    for item in record["chats"]:
        hf = tok.apply_chat_template(item["messages"], chat_template=record["chat_template"],
                                     tokenize=False, add_generation_prompt=True)
        hf_stripped = hf[len(tok.bos_token):] if tok.bos_token and hf.startswith(tok.bos_token) else hf
        hf_ids = tok(hf, add_special_tokens=False)["input_ids"]
        if hf_stripped != item["rendered"] or hf_ids != item["prompt_ids"]:
            chat_disagreements.append({"messages": item["messages"], "transformers_rendered": hf,
                                       "transformers_ids": hf_ids})
    out["chat_disagreements"] = chat_disagreements
    log(f"transformers: {len(chat_disagreements)} chat rendering disagreements")

    log("transformers: loading the GGUF model (weights dequantized to float32)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    eos = sorted(record["eog_token_ids"])
    greedy = []
    for item in record["prompts"] + record["chats"]:
        ids = item["prompt_ids"]
        x = torch.tensor([ids])
        cfg = GenerationConfig(do_sample=False, max_new_tokens=N_PREDICT, eos_token_id=eos, pad_token_id=0)
        with torch.no_grad():
            full = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
            last = model(x).logits[0, -1]
        new = full[0, len(ids):].tolist()
        lp = torch.log_softmax(last.double(), dim=-1)
        top = torch.topk(lp, N_PROBS)
        agree = 0
        for a, b in zip(new, item["greedy_ids"]):
            if a != b:
                break
            agree += 1
        entry = {
            "prompt": item.get("text", item.get("rendered")),
            "greedy_ids": new,
            "greedy_text": tok.decode(new),
            "first_top5_logprobs": [[int(i), round(float(v), 5)] for v, i in zip(top.values, top.indices)],
            "first_top5_logits": [[int(i), round(float(last[i]), 4)] for i in top.indices],
            "agrees_with_llama_cpp_for": agree,
        }
        greedy.append(entry)
        log(f"transformers: {agree}/{len(item['greedy_ids'])} greedy tokens agree with llama.cpp "
            f"for {entry['prompt'][:40]!r}")
    out["greedy"] = greedy
    return out


def compact_json(obj, indent: int = 0) -> str:
    """JSON with one item per line, except that lists of numbers or strings (token ids, pieces)
    and [id, logprob] pairs stay on one line."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {compact_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and not all(isinstance(x, (int, float, str)) for x in obj):
        items = [inner + compact_json(v, indent + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", required=True)
    ap.add_argument("--server-pid", type=int, default=None)
    ap.add_argument("--tokenize-bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--version", required=True, help="llama.cpp tag, e.g. b11434")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=None, help="llama-server's -t (recorded)")
    ap.add_argument("--chat-template-file", default=None,
                    help="the template llama-server was given (recorded; the GGUF's own otherwise)")
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()

    server = Server(args.server, args.server_pid)
    log("waiting for llama-server")
    server.wait_ready()
    props = server.call("/props")
    build_info = props.get("build_info", "")
    if args.version not in build_info:
        sys.exit(f"llamacpp_reference: server reports build {build_info!r}, expected {args.version}")

    # Special ids straight from the vocabulary.
    bos_ids, _ = server.tokenize("", add_special=True)
    bos_id = bos_ids[0] if bos_ids else None
    specials = {}
    for piece in ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]:
        ids, _ = server.tokenize(piece, add_special=False)
        if len(ids) == 1:
            specials[piece] = ids[0]
    # Gemma's end-of-generation set in llama.cpp: <eos> and <end_of_turn>.
    eog = {specials[p] for p in ("<eos>", "<end_of_turn>") if p in specials}

    log("tokenizer cases")
    cases = []
    for text in TOKENIZER_TEXTS:
        with_bos, pieces = server.tokenize(text, add_special=True)
        no_bos, _ = server.tokenize(text, add_special=False)
        for ids, add in ((with_bos, True), (no_bos, False)):
            cli = llama_tokenize(args.tokenize_bin, args.model, text, add)
            if cli != ids:
                sys.exit(f"llamacpp_reference: llama-tokenize {cli} != server /tokenize {ids} for {text!r} (bos {add})")
        case = {
            "text": text,
            "ids_with_bos": with_bos,
            "ids_no_bos": no_bos,
            "pieces": pieces,
            "detokenized": server.detokenize(no_bos),
        }
        if "<" in text:
            case["ids_no_bos_unparsed_special"], _ = server.tokenize(text, add_special=False, parse_special=False)
        cases.append(case)

    log("plain prompts")
    prompts = []
    for text in PROMPTS + [long_prompt()]:
        ids, _ = server.tokenize(text, add_special=True)
        rec = {"text": text, "prompt_ids": ids}
        rec.update(complete(server, ids, eog))
        prompts.append(rec)
        log(f"{len(ids)} prompt tokens -> {rec['greedy_text']!r}")
    if len(prompts[-1]["prompt_ids"]) <= 512:
        sys.exit("llamacpp_reference: the long prompt is not longer than the 512-token sliding window")

    log("chats")
    chats = []
    for messages in CHATS:
        rendered = server.call("/apply-template", {"messages": messages})["prompt"]
        # What /v1/chat/completions does: tokenize the rendered text with add_special and
        # parse_special on. Its usage.prompt_tokens confirms the count.
        ids, _ = server.tokenize(rendered, add_special=True)
        r = server.call("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0.0})
        if r["usage"]["prompt_tokens"] != len(ids):
            sys.exit(f"llamacpp_reference: chat endpoint used {r['usage']['prompt_tokens']} prompt tokens, "
                     f"tokenizing the rendered template gives {len(ids)}")
        rec = {"messages": messages, "add_generation_prompt": True, "rendered": rendered, "prompt_ids": ids}
        rec.update(complete(server, ids, eog))
        chats.append(rec)
        log(f"chat {len(ids)} prompt tokens -> {rec['greedy_text']!r}")

    record = {
        "model": os.path.basename(args.model),
        "llama_cpp": {"version": args.version, "build_info": build_info, "threads": args.threads,
                      "backend": "CPU"},
        "note": "",
        "vocab_size": None,
        "bos_token_id": bos_id,
        "add_bos_token": bos_id is not None,
        "special_token_ids": specials,
        "eog_token_ids": sorted(eog),
        "chat_template": props.get("chat_template"),
        "chat_template_source": (
            f"{os.path.basename(args.chat_template_file)}, passed to llama-server (--chat-template-file)"
            if args.chat_template_file else "the GGUF's tokenizer.chat_template"
        ),
        "generation": {
            "n_predict": N_PREDICT,
            "sampling": "temperature 0, top_k 1 (greedy); stops at an end-of-generation token",
            "top5": "top_logprobs from llama-server /completion with n_probs 5: log-softmax of the "
                    "raw logits over the full vocabulary at each generated position",
        },
        "tokenizer_cases": cases,
        "prompts": prompts,
        "chats": chats,
    }
    model_meta = server.call("/v1/models")
    try:
        record["vocab_size"] = model_meta["data"][0]["meta"]["n_vocab"]
    except (KeyError, IndexError, TypeError):
        pass

    if not args.no_transformers:
        record["transformers_gguf"] = transformers_opinion(args.model, record)

    record["note"] = (
        "Reference from llama.cpp's llama-server (CPU, quantized weights as stored). Prompt ids are "
        "what llama.cpp tokenizes: special tokens parsed, BOS added as the GGUF asks "
        "(tokenizer.ggml.add_bos_token). Chats: `rendered` is the template output as llama.cpp "
        "uses it, which drops the template's leading BOS string because tokenization adds the BOS "
        "token; `prompt_ids` are that text tokenized with BOS (the prompt /v1/chat/completions "
        "evaluates, checked by its usage.prompt_tokens). Continuations are greedy and stop at an "
        "end-of-generation token (kept as the last id) or after n_predict tokens; "
        "top5_logprobs[k] is the top 5 at generated position k. transformers_gguf, when present, "
        "is transformers' GGUF loader on the same file (weights dequantized to float32): "
        "tokenizer and chat disagreements are listed, and its greedy continuations start from "
        "llama.cpp's prompt ids."
    )
    with open(args.out, "w") as f:
        f.write(compact_json(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
