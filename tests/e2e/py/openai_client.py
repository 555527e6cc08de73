"""Talks to Tandem's OpenAI-compatible API with the official `openai` package, as any client would.

Usage: openai_client.py BASE_URL [--api-key KEY] [--max-tokens N] [--ca CA_PEM]
                        [--expect-auth-error | --extras | --structured | --tools]
  BASE_URL is http://<router http address>/v1 (https:// with --ca: the server certificate is
  verified with that CA file through the package's own HTTP client). The key defaults to $OPENAI_API_KEY, then to a
  dummy (the package insists on one; a router without a key ignores it).

Default mode: lists the models, then for a chat completion and a completion makes one streaming
and one non-streaming greedy (temperature 0) request, and checks that each has non-empty text, a
finish_reason and usage, and that the streamed result equals the non-streamed one (same text,
finish_reason and usage). Prints one JSON object with the model id, the number of requests that
generated text, their summed usage, and each result.

--expect-auth-error: checks that a chat completion and the model list are refused with
openai.AuthenticationError (HTTP 401) carrying an OpenAI-style error message, and prints
{"refused": N}.

--extras: the API beyond the basic calls. /tokenize and /detokenize (vLLM's shapes, beside
/v1) round-trip non-ASCII text; a completion whose prompt plus max_tokens exceeds the context is
refused with openai.BadRequestError, code context_length_exceeded, naming both numbers; a chat
message with a `name` is accepted; chat top_logprobs (5) and completion logprobs (3) are sorted,
led by the greedy token, and sum to at most 1. Prints {"tokenize": {...}, "context_error": message,
...}.

--structured: structured output, every answer judged by the package (pydantic) and by
`jsonschema`, never by the server's own parser: `chat.completions.parse` with a pydantic model
(greedy, and seeded sampling), the same schema streamed, `json_object`, vLLM's guided_choice and
guided_regex through extra_body, and a malformed schema refused with a 400 naming
response_format. Prints {"parsed": {...}, "json_object": {...}, ...}.

--tools: tool calling (the model's template must render tools): tool_choice required, a named
function and auto, streamed and not, every call's arguments judged by `jsonschema` against its
function's parameters; parallel_tool_calls false gives one call; then an agent-style loop (call,
feed the result back as a tool message, get the final answer with tool_choice none) and an
unknown tool name refused with a 400 naming tool_choice. Prints {"required": [...], ...}.

Any failed check raises, so the exit status is 1 and the traceback says which.
"""

import argparse
import json
import os
import ssl

import openai


def chat_messages():
    return [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


PROMPT = "The three primary colours are"


def collect_stream(stream, kind):
    text, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index == 0, f"{kind}: unexpected choice index {choice.index}"
            piece = choice.delta.content if kind == "chat" else choice.text
            if piece:
                text.append(piece)
            if choice.finish_reason is not None:
                assert finish is None, f"{kind}: finish_reason sent twice"
                finish = choice.finish_reason
    return {"text": "".join(text), "finish_reason": finish, "usage": usage, "chunks": chunks}


def usage_dict(u):
    assert u is not None, "no usage"
    d = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens}
    assert d["prompt_tokens"] > 0 and d["completion_tokens"] > 0, d
    assert d["total_tokens"] == d["prompt_tokens"] + d["completion_tokens"], d
    return d


def check_pair(kind, plain, streamed, max_tokens):
    for name, r in (("non-streaming", plain), ("streaming", streamed)):
        assert r["text"].strip(), f"{kind} {name}: empty text: {r}"
        assert r["finish_reason"] in ("stop", "length"), f"{kind} {name}: finish_reason {r['finish_reason']!r}"
        r["usage"] = usage_dict(r["usage"])
        assert r["usage"]["completion_tokens"] <= max_tokens, f"{kind} {name}: {r['usage']} over max_tokens"
    assert streamed["chunks"] >= 2, f"{kind}: the stream came as {streamed['chunks']} chunk(s)"
    for field in ("text", "finish_reason", "usage"):
        assert plain[field] == streamed[field], (
            f"{kind}: greedy {field} differs between non-streaming {plain[field]!r} and streaming {streamed[field]!r}"
        )


def run(client, max_tokens):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids, "GET /v1/models listed no model"
    model = ids[0]

    c = client.chat.completions.create(
        model=model, messages=chat_messages(), max_tokens=max_tokens, temperature=0, seed=1
    )
    assert c.object == "chat.completion", c.object
    assert len(c.choices) == 1 and c.choices[0].message.role == "assistant", c.choices
    chat_plain = {"text": c.choices[0].message.content or "", "finish_reason": c.choices[0].finish_reason, "usage": c.usage}
    stream = client.chat.completions.create(
        model=model, messages=chat_messages(), max_tokens=max_tokens, temperature=0, seed=1,
        stream=True, stream_options={"include_usage": True},
    )
    chat_streamed = collect_stream(stream, "chat")
    check_pair("chat", chat_plain, chat_streamed, max_tokens)

    p = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert p.object == "text_completion", p.object
    assert len(p.choices) == 1, p.choices
    text_plain = {"text": p.choices[0].text, "finish_reason": p.choices[0].finish_reason, "usage": p.usage}
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    text_streamed = collect_stream(stream, "completion")
    check_pair("completion", text_plain, text_streamed, max_tokens)

    results = {"chat": chat_plain, "chat_stream": chat_streamed, "completion": text_plain, "completion_stream": text_streamed}
    return {
        "model": model,
        "requests": len(results),
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in results.values()),
        "completion_tokens": sum(r["usage"]["completion_tokens"] for r in results.values()),
        "results": results,
    }


def expect_refused(client):
    refused = 0
    for call in (
        lambda: client.chat.completions.create(model="any", messages=chat_messages(), max_tokens=4),
        lambda: client.models.list(),
    ):
        try:
            call()
        except openai.AuthenticationError as e:
            assert e.status_code == 401, e.status_code
            body = e.body if isinstance(e.body, dict) else {}
            # The package unwraps {"error": {...}} into the error object itself.
            err = body.get("error", body)
            assert isinstance(err, dict) and err.get("message"), f"401 without an OpenAI-style error body: {e.body!r}"
            refused += 1
        else:
            raise AssertionError("a request without the right API key succeeded")
    return {"refused": refused}


def post_json(url, body, api_key):
    """POSTs JSON with the standard library; returns (status, parsed body)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def extras(client, base_url, api_key):
    model = client.models.list().data[0].id
    root = base_url.rstrip("/").removesuffix("/v1")
    text = "Grüße aus Köln, 東京, naïve café ☕ — ünïcödé"
    status, t = post_json(f"{root}/tokenize", {"model": model, "prompt": text, "add_special_tokens": False,
                                               "return_token_strs": True}, api_key)
    assert status == 200, t
    assert t["count"] == len(t["tokens"]) > 0 and len(t["token_strs"]) == t["count"], t
    assert t["max_model_len"] > 0, t
    status, d = post_json(f"{root}/detokenize", {"model": model, "tokens": t["tokens"]}, api_key)
    assert status == 200 and d["prompt"] == text, d

    # A prompt plus max_tokens beyond the context: a 400 naming both numbers.
    long_prompt = " ".join(["word"] * 50)
    status, lp = post_json(f"{root}/tokenize", {"prompt": long_prompt}, api_key)
    assert status == 200, lp
    n_prompt = lp["count"]
    ask = t["max_model_len"] - n_prompt + 1
    try:
        client.completions.create(model=model, prompt=long_prompt, max_tokens=ask, temperature=0)
    except openai.BadRequestError as e:
        err = e.body if isinstance(e.body, dict) else {}
        err = err.get("error", err)
        assert err.get("code") == "context_length_exceeded", e.body
        assert err.get("param") == "max_tokens", e.body
        msg = err.get("message", "")
        assert f"{n_prompt} tokens plus max_tokens {ask}" in msg and str(t["max_model_len"]) in msg, msg
        context_error = msg
    else:
        raise AssertionError("a prompt plus max_tokens beyond the context was accepted")

    c = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "Hello!", "name": "ana"}],
    )
    assert c.choices[0].finish_reason in ("length", "stop"), c

    # top_logprobs: sorted, the greedy token is the top-1, the probabilities sum to at most 1,
    # and each entry's bytes are its token's.
    c = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5,
        messages=[{"role": "user", "content": "Name three colours."}],
    )
    import math

    content = c.choices[0].logprobs.content
    assert content and len(content) == c.usage.completion_tokens, c
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 5, entry
        lps = [t.logprob for t in top]
        assert lps == sorted(lps, reverse=True), lps
        assert top[0].token == entry.token and abs(top[0].logprob - entry.logprob) < 1e-6, entry
        assert sum(math.exp(x) for x in lps) <= 1.0 + 1e-4, lps
        assert all(t.bytes is not None and len(t.bytes) > 0 for t in top), entry
    text_bytes = b"".join(bytes(e.bytes) for e in content)
    assert text_bytes.decode("utf-8", "replace").startswith(c.choices[0].message.content[:1]), (text_bytes, c)
    p = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0, logprobs=3)
    lp = p.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == p.usage.completion_tokens, lp
    for tok, alts in zip(lp.tokens, lp.top_logprobs):
        assert len(alts) == 3 and max(alts, key=alts.get) == tok, (tok, alts)
    choices = several_choices(client, model)
    echo = echo_scores(client, model)
    return {"tokenize": {"count": t["count"], "max_model_len": t["max_model_len"]}, "context_error": context_error,
            "named_chat": c.choices[0].finish_reason, "top_logprobs_tokens": len(content), "choices": choices,
            "echo": echo}


def echo_scores(client, model):
    """echo with logprobs and max_tokens 0 (what evaluation harnesses send for log-likelihood): the
    prompt comes back with each token's log-probability; a greedy continuation scored as prompt
    gets the log-probabilities its generation reported, and is the most likely token each time."""
    import math

    prompt = "The capital of France is"
    c = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    gen = c.choices[0].logprobs
    full = prompt + c.choices[0].text
    e = client.completions.create(model=model, prompt=full, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ch = e.choices[0]
    assert ch.text.endswith(full), (ch.text, full)
    assert e.usage.completion_tokens == 0 and ch.finish_reason == "length", e
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == e.usage.prompt_tokens, lp
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    assert all(x <= 0 for x in lp.token_logprobs[1:]), lp
    k = len(gen.tokens)
    assert lp.tokens[-k:] == gen.tokens, (lp.tokens, gen.tokens)
    for tok, scored, generated, alts in zip(lp.tokens[-k:], lp.token_logprobs[-k:], gen.token_logprobs, lp.top_logprobs[-k:]):
        assert abs(scored - generated) < 1e-2, (tok, scored, generated)
        assert max(alts, key=alts.get) == tok, (tok, alts)
        assert sum(math.exp(x) for x in alts.values()) <= 1.0 + 1e-4, alts
    # Echo while generating: the prompt leads the text.
    g = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert g.choices[0].text.endswith(prompt + c.choices[0].text[:len(g.choices[0].text) - len(prompt)]), g
    return {"prompt_tokens": e.usage.prompt_tokens, "scored": len(lp.token_logprobs) - 1}


def several_choices(client, model):
    """n=3 with a seed: three choices from one prompt, each what a request of its own with seed + i
    gives; the usage counts every choice's tokens; streamed, each choice's deltas under its index."""
    messages = [{"role": "user", "content": "Write a short line about the sea."}]
    ask = dict(model=model, messages=messages, max_tokens=12, temperature=1.0, seed=11)
    c = client.chat.completions.create(n=3, logprobs=True, **ask)
    assert [ch.index for ch in c.choices] == [0, 1, 2], c
    texts = [ch.message.content for ch in c.choices]
    assert sum(len(ch.logprobs.content) for ch in c.choices) == c.usage.completion_tokens, c
    assert len(set(texts)) > 1, f"three sampled choices came out alike: {texts}"
    again = client.chat.completions.create(n=3, **ask)
    assert [ch.message.content for ch in again.choices] == texts, (texts, again)
    for i, text in enumerate(texts):
        one = client.chat.completions.create(**{**ask, "seed": 11 + i})
        assert one.choices[0].message.content == text, (i, text, one)
    streamed = ["", "", ""]
    finishes = [0, 0, 0]
    for chunk in client.chat.completions.create(n=3, stream=True, **ask):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
            finishes[ch.index] += ch.finish_reason is not None
    assert streamed == texts and finishes == [1, 1, 1], (streamed, texts, finishes)
    p = client.completions.create(model=model, prompt="The sea is", max_tokens=6, temperature=0, n=2)
    assert len(p.choices) == 2 and p.choices[0].text == p.choices[1].text, p
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, n=100)
    except openai.BadRequestError as e:
        err = e.body if isinstance(e.body, dict) else {}
        assert err.get("error", err).get("param") == "n", e.body
    else:
        raise AssertionError("n=100 was accepted")
    return {"n": len(c.choices), "distinct": len(set(texts))}


def structured(client):
    import re
    from typing import Literal

    import jsonschema
    import pydantic

    model = client.models.list().data[0].id

    class Pet(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=24)
        species: Literal["cat", "dog", "bird"]
        age: int = pydantic.Field(ge=0, le=40)

    class Household(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str = pydantic.Field(max_length=24)
        pets: list[Pet] = pydantic.Field(max_length=2)

    messages = [{"role": "user", "content": "Describe a household in Paris with a cat named Tom, as JSON."}]
    out = {}
    for label, extra in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8, "seed": 11})):
        c = client.chat.completions.parse(model=model, messages=messages, response_format=Household,
                                          max_tokens=200, **extra)
        choice = c.choices[0]
        assert choice.finish_reason == "stop", (label, choice)
        parsed = choice.message.parsed
        assert isinstance(parsed, Household), (label, choice.message)
        # The package already validated it; jsonschema judges the raw text against the schema sent.
        jsonschema.validate(json.loads(choice.message.content), Household.model_json_schema())
        out[label] = parsed.model_dump()

    # The same schema streamed: the deltas concatenate to a valid document.
    schema = Household.model_json_schema()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "household", "schema": schema, "strict": True}},
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop", (finish, text)
    jsonschema.validate(json.loads(text), schema)
    assert json.loads(text) == out["greedy"], (text, out["greedy"])

    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a cat."}],
                                       max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert c.choices[0].finish_reason == "stop", c
    obj = json.loads(c.choices[0].message.content)
    assert isinstance(obj, dict), obj

    choices = ["yes", "no", "maybe"]
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is water wet?"}],
                                       max_tokens=10, temperature=0, extra_body={"guided_choice": choices})
    assert c.choices[0].message.content in choices, c
    p = client.completions.create(model=model, prompt="A US phone number:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", p.choices[0].text), p

    try:
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strnig"}}},
        )
    except openai.BadRequestError as e:
        err = e.body if isinstance(e.body, dict) else {}
        err = err.get("error", err)
        assert err.get("param") == "response_format", e.body
        bad_schema = err.get("message", "")
    else:
        raise AssertionError("a malformed schema was accepted")
    return {"parsed": out, "json_object": obj, "choice": c.choices[0].message.content,
            "regex": p.choices[0].text, "bad_schema": bad_schema}


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"], "additionalProperties": False}}},
]


def check_calls(calls, allowed=None):
    """Every call names a defined function and its arguments validate against its schema."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = []
    for c in calls:
        assert c.type == "function" and c.id, c
        assert c.function.name in schemas, c
        if allowed:
            assert c.function.name == allowed, (c, allowed)
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, schemas[c.function.name])
        out.append({"name": c.function.name, "arguments": args})
    return out


def stream_calls(stream):
    """Accumulates a streamed answer's content and tool-call deltas, as OpenAI clients do."""
    from types import SimpleNamespace

    content, finish, calls = "", None, {}
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = d.id or c["id"]
            if d.function:
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    objs = [SimpleNamespace(id=c["id"], type="function",
                            function=SimpleNamespace(name=c["name"], arguments=c["arguments"]))
            for _, c in sorted(calls.items())]
    return content, finish, objs


def tools(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = {}
    # Room for the most parallel calls a forced answer may hold (8), on a small vocabulary too.
    c = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=1000, temperature=0)
    ch = c.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    out["required"] = check_calls(ch.message.tool_calls)

    c = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, temperature=0.9, seed=4)
    assert c.choices[0].finish_reason == "tool_calls" and len(c.choices[0].message.tool_calls) == 1, c
    out["single"] = check_calls(c.choices[0].message.tool_calls)

    named = {"type": "function", "function": {"name": "add"}}
    content, finish, calls = stream_calls(client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=300, temperature=0, stream=True))
    assert finish == "tool_calls" and calls and content == "", (finish, content, calls)
    out["named_streamed"] = check_calls(calls, allowed="add")

    # auto: the model decides; whatever it answers is well formed.
    for stream in (False, True):
        if stream:
            content, finish, calls = stream_calls(client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, max_tokens=40, temperature=0, stream=True))
        else:
            c = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=40,
                                               temperature=0)
            content, finish, calls = c.choices[0].message.content, c.choices[0].finish_reason, \
                c.choices[0].message.tool_calls or []
        assert finish in ("stop", "length", "tool_calls"), finish
        assert (finish == "tool_calls") == bool(calls), (finish, calls)
        check_calls(calls)
        assert calls or isinstance(content, str), (content, calls)
        out["auto_streamed" if stream else "auto"] = finish

    # An agent's loop: call, run the tool, hand back the result, get the answer.
    c = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=300, temperature=0)
    call = c.choices[0].message.tool_calls[0]
    check_calls([call], allowed="get_weather")
    # The answer goes back into the history as it came, as agent code does with openai-python.
    history = messages + [
        c.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    final = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=16, temperature=0)
    ch = final.choices[0]
    assert ch.finish_reason in ("stop", "length") and not ch.message.tool_calls, ch
    assert isinstance(ch.message.content, str), ch
    # The same request without the call and its result is shorter: the history reached the prompt
    # (with tool_choice none, the generic format leaves the tools' description out).
    base = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=1, temperature=0)
    assert final.usage.prompt_tokens > base.usage.prompt_tokens, "the history reached the prompt"
    out["loop"] = {"call": call.function.name, "answer_tokens": final.usage.completion_tokens}

    try:
        client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "fly"}})
    except openai.BadRequestError as e:
        err = e.body if isinstance(e.body, dict) else {}
        err = err.get("error", err)
        assert err.get("param") == "tool_choice" and "fly" in err.get("message", ""), e.body
    else:
        raise AssertionError("an unknown tool name was accepted")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or "no-key")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ca")
    ap.add_argument("--expect-auth-error", action="store_true")
    ap.add_argument("--extras", action="store_true")
    ap.add_argument("--structured", action="store_true")
    ap.add_argument("--tools", action="store_true")
    a = ap.parse_args()
    # No retries: every request the server sees is one the caller counts in the metrics.
    http_client = None
    if a.ca:
        http_client = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=a.ca))
    client = openai.OpenAI(
        base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=120, http_client=http_client
    )
    if a.extras:
        summary = extras(client, a.base_url, a.api_key)
    elif a.structured:
        summary = structured(client)
    elif a.tools:
        summary = tools(client)
    elif a.expect_auth_error:
        summary = expect_refused(client)
    else:
        summary = run(client, a.max_tokens)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
