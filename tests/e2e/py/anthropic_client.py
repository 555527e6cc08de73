"""Talks to Tandem's Messages API with the official `anthropic` package, as any client would.

Usage: anthropic_client.py BASE_URL --api-key KEY
  BASE_URL is http://<router http address> (the package adds /v1/messages). The router must run
  with --api-key KEY.

Checks, each judged by the package's own types and by `jsonschema`, never by the server's parser:
- create: a greedy (temperature 0, through extra_body) message has one non-empty text block, a
  stop reason and usage; a stop sequence the answer reaches ends it with stop_reason
  "stop_sequence" naming it.
- stream: `messages.stream` yields text deltas whose concatenation is the final message's text,
  and the final message equals the greedy create's (text, stop reason, output tokens).
- tools: a forced call (tool_choice {"type": "tool"}) gives a tool_use block whose input validates
  against the tool's input_schema; the result handed back as a tool_result block (and the answer
  as it came, as agent code does) gets a text answer with tool_choice none. Streamed, the forced
  call comes as a tool_use block too.
- count_tokens: for a plain conversation and for the one with tools, equals the create call's
  input_tokens + cache_read_input_tokens (the prompt's whole length).
- errors: a wrong model is anthropic.NotFoundError (not_found_error), max_tokens 0 and an
  unknown tool name are anthropic.BadRequestError (invalid_request_error) whose message names
  the field, an image block is refused naming its index; a wrong key is
  anthropic.AuthenticationError, and the key as `x-api-key` alone (plain HTTP) works.

Prints one JSON object with what it saw. Any failed check raises, so the exit status is 1 and
the traceback says which.
"""

import argparse
import json
import urllib.error
import urllib.request

import anthropic
import jsonschema

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
SYSTEM = "You are a helpful assistant."
GREEDY = {"temperature": 0}


def text_of(message):
    blocks = [b for b in message.content if b.type == "text"]
    return "".join(b.text for b in blocks)


def error_of(e):
    body = e.body if isinstance(e.body, dict) else {}
    assert body.get("type") == "error", f"not an Anthropic error body: {e.body!r}"
    return body["error"]


def plain(client, model):
    m = client.messages.create(model=model, max_tokens=24, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == model, m
    assert m.id.startswith("msg_"), m.id
    assert [b.type for b in m.content] == ["text"], m.content
    assert m.content[0].text.strip(), m
    assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason
    assert m.stop_sequence is None, m
    u = m.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) > 0 and 0 < u.output_tokens <= 24, u
    return m


def stop_sequence(client, model, reference):
    """A stop sequence taken from the greedy answer ends the same answer there."""
    words = reference.split()
    assert len(words) >= 3, reference
    stop = words[2]
    m = client.messages.create(model=model, max_tokens=24, system=SYSTEM, messages=QUESTION,
                               stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, m
    assert stop not in text_of(m) and reference.startswith(text_of(m)), (text_of(m), reference)
    return {"stop": stop, "text": text_of(m)}


def streamed(client, model, reference):
    deltas = []
    events = []
    with client.messages.stream(model=model, max_tokens=24, system=SYSTEM, messages=QUESTION,
                                extra_body=GREEDY) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "text":
                deltas.append(event.text)
        final = stream.get_final_message()
    assert len(deltas) >= 2, f"the text came in {len(deltas)} delta(s)"
    assert "".join(deltas) == text_of(final), (deltas, final)
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    for name in ("content_block_start", "content_block_stop", "message_delta"):
        assert name in events, events
    assert text_of(final) == text_of(reference), (final, reference)
    assert final.stop_reason == reference.stop_reason, (final, reference)
    assert final.usage.output_tokens == reference.usage.output_tokens, (final.usage, reference.usage)
    return {"deltas": len(deltas), "text": text_of(final)}


def prompt_length(usage):
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def tools(client, model):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    ask = dict(model=model, max_tokens=200, system=SYSTEM, tools=[WEATHER], extra_body=GREEDY)
    forced = {"type": "tool", "name": "get_weather"}
    m = client.messages.create(messages=messages, tool_choice=forced, **ask)
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(calls) == 1, m
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_"), call
    jsonschema.validate(call.input, WEATHER["input_schema"])
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=messages, tools=[WEATHER],
                                           tool_choice=forced)
    assert counted.input_tokens == prompt_length(m.usage), (counted, m.usage)

    # Streamed, the forced call is a tool_use block the package assembles from its JSON deltas.
    with client.messages.stream(messages=messages, tool_choice=forced, **ask) as stream:
        final = stream.get_final_message()
    streamed_calls = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(streamed_calls) == 1, final
    assert streamed_calls[0].input == call.input, (streamed_calls[0], call)

    # The agent's loop: the answer goes back as it came, the tool's result as a tool_result.
    history = messages + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": json.dumps({"temperature": 21, "sky": "clear"})}]},
    ]
    final = client.messages.create(messages=history, tool_choice={"type": "none"},
                                   **{**ask, "max_tokens": 32})
    assert final.stop_reason in ("end_turn", "max_tokens"), final
    assert [b.type for b in final.content] == ["text"], final.content
    assert isinstance(final.content[0].text, str), final
    # The whole history reached the prompt: counted alike, and longer than the question alone.
    counted_history = client.messages.count_tokens(model=model, system=SYSTEM, messages=history, tools=[WEATHER],
                                                   tool_choice={"type": "none"})
    assert counted_history.input_tokens == prompt_length(final.usage), (counted_history, final.usage)
    alone = client.messages.count_tokens(model=model, system=SYSTEM, messages=messages, tools=[WEATHER],
                                         tool_choice={"type": "none"})
    assert counted_history.input_tokens > alone.input_tokens, (counted_history, alone)
    return {"call": {"name": call.name, "input": call.input}, "count_tokens": counted.input_tokens,
            "answer_tokens": final.usage.output_tokens, "answer_stop": final.stop_reason}


def count(client, model, reference):
    n = client.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION)
    assert isinstance(n.input_tokens, int) and n.input_tokens > 0, n
    assert n.input_tokens == prompt_length(reference.usage), (n, reference.usage)
    return n.input_tokens


def errors(client, model, base_url, api_key):
    out = {}
    try:
        client.messages.create(model="no-such-model", max_tokens=8, messages=QUESTION)
    except anthropic.NotFoundError as e:
        err = error_of(e)
        assert err["type"] == "not_found_error" and "no-such-model" in err["message"], err
        out["model"] = err["type"]
    else:
        raise AssertionError("an unknown model was accepted")
    for name, call, field in (
        ("max_tokens", lambda: client.messages.create(model=model, max_tokens=0, messages=QUESTION), "max_tokens"),
        ("tool_choice", lambda: client.messages.create(model=model, max_tokens=8, messages=QUESTION,
                                                       tools=[WEATHER], tool_choice={"type": "tool", "name": "fly"}),
         "tool_choice.name"),
        ("image", lambda: client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]),
         "messages[0].content[0]"),
    ):
        try:
            call()
        except anthropic.BadRequestError as e:
            err = error_of(e)
            assert err["type"] == "invalid_request_error", err
            assert err["message"].startswith(field), (field, err)
            out[name] = err["message"]
        else:
            raise AssertionError(f"{name}: the bad request was accepted")

    wrong = anthropic.Anthropic(base_url=base_url, api_key="wrong-key", max_retries=0, timeout=60)
    try:
        wrong.messages.create(model=model, max_tokens=8, messages=QUESTION)
    except anthropic.AuthenticationError as e:
        out["auth"] = error_of(e)["type"]
        assert out["auth"] == "authentication_error", e.body
    else:
        raise AssertionError("a wrong API key was accepted")

    # The key as Anthropic's own header, alone.
    req = urllib.request.Request(
        f"{base_url.rstrip('/')}/v1/messages", method="POST",
        data=json.dumps({"model": model, "max_tokens": 4, "messages": QUESTION}).encode(),
        headers={"content-type": "application/json", "x-api-key": api_key, "anthropic-version": "2023-06-01"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = json.loads(r.read())
    assert r.status == 200 and body["type"] == "message", body
    out["x_api_key"] = r.status
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("--api-key", required=True)
    a = ap.parse_args()
    # No retries: every request the server sees is one this script made.
    client = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reference = plain(client, model)
    summary = {
        "model": model,
        "text": text_of(reference),
        "usage": reference.usage.model_dump(exclude_none=True),
        "stop_sequence": stop_sequence(client, model, text_of(reference)),
        "stream": streamed(client, model, reference),
        "count_tokens": count(client, model, reference),
        "tools": tools(client, model),
        "errors": errors(client, model, a.base_url, a.api_key),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
