"""Talks to Tandem's Responses API (/v1/responses) with the official `openai` package, as any client
would. Every object and event is parsed by the package (and the responses and raw stream events
validated against its types, field by field); answers are judged by `jsonschema`, never by the
server's own parser.

Usage: responses_client.py BASE_URL [--api-key KEY]
  BASE_URL is http://<router http address>/v1.

Checks, in order:
- a plain answer (`responses.create(input=...)`, greedy): completed or cut at max_output_tokens,
  non-empty `output_text`, usage that adds up;
- the same request streamed (`stream=True`): typed events numbered in order, from
  `response.created` to `response.completed`, whose text deltas add up to the same answer as the
  non-streamed one;
- a function tool with `tool_choice="required"` through `responses.stream(...)`: one
  `function_call` item whose arguments validate against the tool's schema; then its
  `function_call_output` handed back with only `previous_response_id` (the server holds the rest
  of the conversation) gives a text answer, on a prompt longer than the question alone;
- `text.format` json_schema (strict): the output parses and validates; `responses.parse` with a
  pydantic model too;
- `responses.retrieve(id)` gives the stored response; `responses.delete(id)` forgets it, after
  which retrieve raises `openai.NotFoundError`; so does a response made with `store=False`, and an
  unknown `previous_response_id`;
- a built-in tool (`web_search`) is refused with `openai.BadRequestError` naming `tools[0].type`.

Prints one JSON object summing it up. Any failed check raises (exit status 1).
"""

import argparse
import json
import os

import jsonschema
import openai
import pydantic
from openai.types.responses import Response, ResponseStreamEvent

# The package builds its objects without validating them; these validate every field, so that a
# missing or mistyped one fails here.
STRICT_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def strict(r):
    """`r` (a response) as the package's type validates it."""
    Response.model_validate(r.to_dict())
    return r

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "species": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 40},
    },
    "required": ["name", "species", "age"],
    "additionalProperties": False,
}

QUESTION = "What is the capital of France? Answer in one sentence."


def err_of(e):
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body)


def check_usage(r):
    u = r.usage
    assert u is not None, r
    assert u.input_tokens > 0 and u.output_tokens > 0, u
    assert u.total_tokens == u.input_tokens + u.output_tokens, u
    assert u.input_tokens_details.cached_tokens <= u.input_tokens, u
    return {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens}


def check_finished(r, max_output_tokens):
    assert r.object == "response" and r.id.startswith("resp_"), r
    assert r.status in ("completed", "incomplete"), r
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens", r
    assert r.error is None, r
    assert r.usage.output_tokens <= max_output_tokens, r.usage


def plain(client, model):
    r = strict(client.responses.create(model=model, input=QUESTION, max_output_tokens=32, temperature=0))
    check_finished(r, 32)
    assert r.output_text.strip(), r
    assert [o.type for o in r.output] == ["message"], r.output
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text", r.output
    assert r.model == model and r.max_output_tokens == 32 and r.temperature == 0, r
    return r, {"text": r.output_text, "status": r.status, "usage": check_usage(r)}


def streamed(client, model, expected):
    stream = client.responses.create(model=model, input=QUESTION, max_output_tokens=32, temperature=0,
                                     stream=True)
    events = list(stream)
    for e in events:
        STRICT_EVENT.validate_python(e.to_dict())
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert [e.sequence_number for e in events] == list(range(len(events))), "sequence numbers out of order"
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1, f"one response id across the lifecycle events: {ids}"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2, f"the text came in {len(deltas)} delta(s)"
    final = events[-1].response
    text = "".join(deltas)
    assert text == final.output_text, (text, final.output_text)
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text, done
    assert text == expected.output_text, f"greedy streamed {text!r} differs from {expected.output_text!r}"
    assert final.status == expected.status and final.usage.output_tokens == expected.usage.output_tokens
    return {"events": len(events), "deltas": len(deltas), "status": final.status}


def function_call(client, model):
    with client.responses.stream(
        model=model, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=200, temperature=0,
    ) as stream:
        events = list(stream)
        for e in events:
            STRICT_EVENT.validate_python(e.to_dict())
        types = [e.type for e in events]
        first = strict(stream.get_final_response())
    assert first.status == "completed", first
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) >= 1, first.output
    for c in calls:
        assert c.name == "get_weather" and c.call_id and c.status == "completed", c
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    for t in ("response.output_item.added", "response.function_call_arguments.delta",
              "response.function_call_arguments.done", "response.output_item.done", "response.completed"):
        assert t in types, (t, types)
    assert "response.output_text.delta" not in types, types
    call = calls[0]

    # Only the new item: the server holds the rest of the conversation.
    result = {"temperature": 21, "unit": "celsius", "sky": "clear"}
    second = strict(client.responses.create(
        model=model, previous_response_id=first.id, max_output_tokens=32, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(result)}],
    ))
    check_finished(second, 32)
    assert second.previous_response_id == first.id, second
    assert second.output_text.strip(), second
    assert not [o for o in second.output if o.type == "function_call"], "no tools were given this time"
    # The question alone, as a prompt: the continuation's holds it and the turns after it.
    alone = client.responses.create(model=model, input="What is the weather in Paris?", max_output_tokens=1,
                                    store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens, "the earlier turns reached the prompt"
    return {"call": {"name": call.name, "arguments": json.loads(call.arguments)}, "answer": second.output_text,
            "input_tokens": [alone.usage.input_tokens, second.usage.input_tokens]}


def structured(client, model):
    r = client.responses.create(
        model=model, input="Describe a cat named Tom as JSON.", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}},
    )
    assert strict(r).status == "completed", r
    doc = json.loads(r.output_text)
    jsonschema.validate(doc, PET)
    assert r.text.format.type == "json_schema", r.text

    class Pet(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=24)
        species: str = pydantic.Field(pattern="^(cat|dog|bird)$")
        age: int = pydantic.Field(ge=0, le=40)

    p = client.responses.parse(model=model, input="Describe a dog named Rex as JSON.", text_format=Pet,
                               max_output_tokens=200, temperature=0)
    assert isinstance(p.output_parsed, Pet), p
    jsonschema.validate(json.loads(p.output_text), Pet.model_json_schema())
    return {"json_schema": doc, "parsed": p.output_parsed.model_dump()}


def stored(client, model, r):
    got = strict(client.responses.retrieve(r.id))
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status, (got, r)
    client.responses.delete(r.id)
    try:
        client.responses.retrieve(r.id)
    except openai.NotFoundError as e:
        deleted = err_of(e).get("message", "")
        assert r.id in deleted, e.body
    else:
        raise AssertionError("a deleted response was still retrieved")

    unstored = client.responses.create(model=model, input="Say hi.", max_output_tokens=4, store=False)
    assert unstored.store is False, unstored
    try:
        client.responses.retrieve(unstored.id)
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("a response made with store=False was retrieved")

    try:
        client.responses.create(model=model, input="Hi", max_output_tokens=4, previous_response_id="resp_unknown")
    except openai.NotFoundError as e:
        err = err_of(e)
        assert err.get("param") == "previous_response_id" and "resp_unknown" in err.get("message", ""), e.body
        unknown = err.get("message")
    else:
        raise AssertionError("an unknown previous_response_id was accepted")
    return {"retrieved": True, "deleted": deleted, "unknown_previous": unknown}


def refused(client, model):
    try:
        client.responses.create(model=model, input="Search the web.", tools=[{"type": "web_search"}])
    except openai.BadRequestError as e:
        err = err_of(e)
        assert err.get("param") == "tools[0].type", e.body
        msg = err.get("message", "")
        assert "tools[0].type" in msg and "web_search" in msg, msg
        return msg
    raise AssertionError("a built-in tool was accepted")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or "no-key")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    first, summary_plain = plain(client, model)
    summary = {
        "model": model,
        "plain": summary_plain,
        "streamed": streamed(client, model, first),
        "function_call": function_call(client, model),
        "structured": structured(client, model),
    }
    summary["stored"] = stored(client, model, first)
    summary["refused"] = refused(client, model)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
