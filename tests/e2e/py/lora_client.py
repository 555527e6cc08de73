"""LoRA adapters through Tandem's OpenAI-compatible API, with the official `openai` package.

Usage: lora_client.py BASE_URL --plan FILE [--concurrency N]

BASE_URL is http://<router http address>/v1.

--plan: FILE is a JSON list of requests {"model", "prompt" (token ids), "max_tokens",
"stream"}; they run N at a time (threads), greedy (temperature 0), as completions. Before them
the model list is read, and a request naming a model nobody serves must fail with
openai.NotFoundError. Prints {"models": [{"id", "parent"}...], "results": [{"text",
"finish_reason", "completion_tokens"}...], "unknown_model_error": message}.

Any failed check raises, so the exit status is 1 and the traceback says which.
"""

import argparse
import concurrent.futures
import json

import openai


def run_one(client, req):
    kwargs = dict(model=req["model"], prompt=req["prompt"], max_tokens=req["max_tokens"], temperature=0)
    if req.get("stream"):
        text, finish, tokens = [], None, None
        for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
            for c in chunk.choices:
                text.append(c.text or "")
                if c.finish_reason:
                    finish = c.finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return {"text": "".join(text), "finish_reason": finish, "completion_tokens": tokens}
    r = client.completions.create(**kwargs)
    return {
        "text": r.choices[0].text,
        "finish_reason": r.choices[0].finish_reason,
        "completion_tokens": r.usage.completion_tokens,
    }


def plan(base_url, path, concurrency):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    with open(path) as f:
        reqs = json.load(f)
    models = [{"id": m.id, "parent": getattr(m, "parent", None)} for m in client.models.list().data]
    try:
        client.completions.create(model="no-such-adapter", prompt=[1, 2, 3], max_tokens=2)
        raise AssertionError("a request naming an unknown model was served")
    except openai.NotFoundError as e:
        unknown = str(e)
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda r: run_one(client, r), reqs))
    print(json.dumps({"models": models, "results": results, "unknown_model_error": unknown}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base_url")
    p.add_argument("--plan", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    a = p.parse_args()
    plan(a.base_url, a.plan, a.concurrency)


if __name__ == "__main__":
    main()
