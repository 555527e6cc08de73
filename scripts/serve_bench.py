#!/usr/bin/env python3
"""Driver of scripts/serve-bench.sh: one OpenAI streaming client for every server measured.

Two subcommands (standard library only):

  run     --name NAME --url http://HOST:PORT --out RESULT.json [options]
          Sends one warm-up request, then, for each concurrency C, a closed loop: C client
          threads, each sending its requests back to back, until max(4, REQUESTS_PER_STREAM x C)
          requests have been sent. Every request is POST /v1/completions with "stream": true,
          "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": true and
          "stream_options": {"include_usage": true}. Writes the level figures to RESULT.json.
          Exit status: 0 all requests succeeded, 1 some failed (figures still written), 2 the
          server could not be used at all (no model list, or the warm-up failed).

  report  RESULT.json... [--json-out PATH] [--target-concurrency 16]
          Prints the markdown table (one row per server x concurrency) and the targets, each met
          or NOT met; writes everything to PATH as JSON when asked. Exit status 1 when any request
          of any server failed.

Prompts: request number i (counted over the whole run: the warm-up is not one of them, and every
level takes the next numbers) gets "Request i." followed by PROMPT_WORDS words drawn from a fixed
word list by random.Random(seed * 1_000_003 + i), then an instruction to continue writing. So no
two requests share more than a few leading tokens (nothing for a prefix cache to reuse), and every
server gets the same prompts for the same request numbers.

Measurement, per request (clock: time.perf_counter):
  TTFT    from just before the request is sent (connection set-up included) to the arrival of
          the first SSE event whose choice carries non-empty text.
  ITL     the gaps between successive events that carry text. A gap is split evenly among the
          tokens its (later) event carries when that is known (the event has logprobs listing its
          tokens, which this client does not ask for); otherwise an event counts as one token.
          The column tok/chunk (output tokens / text events) shows whether servers send more than
          one token per event: above 1, the ITL percentiles are per event, not per token.
  tokens  usage.completion_tokens of the final chunk when present, else the count of text events.
A request fails on a transport error, an HTTP status other than 200, an error event, a stream that
ends without "data: [DONE]", or zero output tokens; failures are counted, never raised.
Per level: output tok/s = output tokens of its successful requests / wall time of the level (first
request sent to last stream closed); percentiles are nearest-rank over all samples of the level.
"""

import argparse
import http.client
import json
import math
import random
import sys
import threading
import time
import urllib.parse

WORDS = """
river mountain lantern harbor garden window thunder meadow silver forest candle
journey whisper village ocean morning evening shadow bridge castle winter summer
autumn spring market library engine compass feather mirror orchard valley desert
island kitchen painter sailor farmer doctor teacher stranger traveler merchant
quiet bright ancient gentle hollow golden narrow distant restless patient curious
walked carried opened listened remembered followed painted counted gathered wandered
builds watches writes sings climbs waits answers borrows measures repairs
north south clock letter story song map stone cloud rain snow wind fire smoke
bread apple honey salt tea coffee wool paper glass iron copper timber rope
because although while before after during beneath across beyond between through
slowly quickly softly nearly almost perhaps always rarely often together
""".split()

CLOSING = "Continue writing the story in the same style:"


def prompt_for(seed, i, n_words):
    """The prompt of request number i: unique lead, seeded words, closing instruction."""
    rng = random.Random(seed * 1_000_003 + i)
    body = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return f"Request {i}. {body}. {CLOSING}"


def percentile(samples, p):
    """Nearest-rank percentile (p in 0..100) of samples; None when there are none."""
    if not samples:
        return None
    s = sorted(samples)
    rank = max(1, math.ceil(p / 100 * len(s)))
    return s[rank - 1]


class Server:
    """A server's OpenAI API at base URL http://host:port."""

    def __init__(self, url, timeout_s):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"expected http://HOST:PORT, got {url}")
        self.host, self.port = u.hostname, u.port or 80
        self.timeout_s = timeout_s

    def connect(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def model_id(self):
        conn = self.connect()
        try:
            conn.request("GET", "/v1/models")
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {body[:300]!r}")
            return json.loads(body)["data"][0]["id"]
        finally:
            conn.close()


class Outcome:
    """What one streamed request gave."""

    def __init__(self):
        self.error = None
        self.ttft_s = None
        self.itl_s = []
        self.tokens = 0
        self.text_events = 0
        self.prompt_tokens = None
        self.cached_tokens = None


def tokens_in(choice):
    """Tokens an event's choice is known to carry (from its logprobs), else None."""
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        listed = lp.get("tokens") or lp.get("content")
        if isinstance(listed, list) and listed:
            return len(listed)
    return None


def sse_events(resp):
    """Yields (arrival time, data) per server-sent event of a response."""
    data, t_first = [], None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.decode("utf-8").rstrip("\r\n")
        if line == "":
            if data:
                yield t_first, "\n".join(data)
            data, t_first = [], None
        elif line.startswith("data:"):
            if t_first is None:
                t_first = time.perf_counter()
            data.append(line[5:].lstrip(" "))
        # Comments (": ...") and other fields (event:, id:, retry:) carry nothing measured here.
    if data:
        yield t_first, "\n".join(data)


def stream_completion(server, model, prompt, max_tokens):
    """Sends one streaming completion and measures it; never raises."""
    out = Outcome()
    body = json.dumps({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    conn = server.connect()
    t_sent = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300].decode('utf-8', 'replace')}"
            return out
        done, usage_tokens, t_last = False, None, None
        for t, data in sse_events(resp):
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                out.error = f"error event: {json.dumps(event['error'])[:300]}"
                return out
            usage = event.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                usage_tokens = usage["completion_tokens"]
                out.prompt_tokens = usage.get("prompt_tokens")
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in event.get("choices") or []:
                if not choice.get("text"):
                    continue
                out.text_events += 1
                if t_last is None:
                    out.ttft_s = t - t_sent
                else:
                    k = tokens_in(choice) or 1
                    out.itl_s.extend([(t - t_last) / k] * k)
                t_last = t
        out.tokens = usage_tokens if usage_tokens is not None else out.text_events
        if not done:
            out.error = "stream ended without [DONE]"
        elif out.tokens == 0 or out.text_events == 0:
            out.error = "no output tokens"
    except Exception as e:  # noqa: BLE001 - any failure is the request's, never the driver's
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def run_level(server, model, prompts, concurrency, max_tokens):
    """Closed loop: `concurrency` threads send the prompts, each its next one when one ends."""
    outcomes = [None] * len(prompts)
    lock = threading.Lock()
    next_index = [0]

    def client():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(prompts):
                return
            outcomes[i] = stream_completion(server, model, prompts[i], max_tokens)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall_s = time.perf_counter() - t0

    ok = [o for o in outcomes if o.error is None]
    failed = [o for o in outcomes if o.error is not None]
    ttft_ms = [o.ttft_s * 1000 for o in ok]
    itl_ms = [g * 1000 for o in ok for g in o.itl_s]
    tokens = sum(o.tokens for o in ok)
    events = sum(o.text_events for o in ok)
    prompt = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    return {
        "concurrency": concurrency,
        "requests": len(outcomes),
        "failed": len(failed),
        "errors": sorted({o.error for o in failed})[:5],
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": {"p50": percentile(ttft_ms, 50), "p99": percentile(ttft_ms, 99)},
        "itl_ms": {"p50": percentile(itl_ms, 50), "p99": percentile(itl_ms, 99)},
        "itl_samples": len(itl_ms),
        "tokens_per_text_event": tokens / events if events else None,
        # From the usage of the final chunks, as each server reports it (None when it does not).
        "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
        "cached_prompt_tokens_mean": sum(cached) / len(cached) if cached else None,
    }


def log(msg):
    print(f"serve-bench: {msg}", file=sys.stderr, flush=True)


def cmd_run(a):
    server = Server(a.url, a.timeout_s)
    try:
        model = server.model_id()
    except (OSError, http.client.HTTPException, ValueError, RuntimeError, KeyError, IndexError) as e:
        log(f"{a.name}: cannot list the models at {a.url}: {e}")
        return 2
    warm = stream_completion(server, model, "Warm-up request. Say something short:", 8)
    if warm.error is not None:
        log(f"{a.name}: the warm-up request failed: {warm.error}")
        return 2

    levels, first = [], 0
    for c in a.concurrency:
        n = max(4, a.requests_per_stream * c)
        prompts = [prompt_for(a.seed, first + j, a.prompt_words) for j in range(n)]
        first += n
        log(f"{a.name}: concurrency {c}, {n} requests")
        level = run_level(server, model, prompts, c, a.output_tokens)
        log(f"{a.name}: concurrency {c}: {level['output_tok_per_s']:.1f} output tok/s, {level['failed']} failed; "
            f"prompt tokens per request {fmt(level['prompt_tokens_mean'])}, of them cached "
            f"{fmt(level['cached_prompt_tokens_mean'])} (as the server reports them)")
        for err in level["errors"]:
            log(f"{a.name}: concurrency {c}: failed request: {err}")
        levels.append(level)

    result = {"server": a.name, "url": a.url, "model": model, "levels": levels,
              "config": {"output_tokens": a.output_tokens, "prompt_words": a.prompt_words,
                         "requests_per_stream": a.requests_per_stream, "seed": a.seed}}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    return 1 if any(l["failed"] for l in levels) else 0


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def targets(results, at):
    """The targets at concurrency `at`, as (description, met) pairs; met is None when unmeasured."""
    def level(name):
        for r in results:
            if r["server"] == name:
                for l in r["levels"]:
                    if l["concurrency"] == at and l["failed"] < l["requests"]:
                        return l
        return None

    llama, colo, disagg = level("llama-server"), level("tandem colocated"), level("tandem disaggregated")
    out = []
    for name, t in (("tandem colocated", colo), ("tandem disaggregated", disagg)):
        if t is None or llama is None:
            out.append((f"{name}: output tok/s >= 1.5x llama-server's", None))
        else:
            want = 1.5 * llama["output_tok_per_s"]
            out.append((f"{name}: output tok/s >= 1.5x llama-server's: {t['output_tok_per_s']:.1f} vs "
                        f"{want:.1f} (1.5 x {llama['output_tok_per_s']:.1f})", t["output_tok_per_s"] >= want))
        p99 = None if t is None else t["itl_ms"]["p99"]
        llama_p99 = None if llama is None else llama["itl_ms"]["p99"]
        if p99 is None or llama_p99 is None:
            out.append((f"{name}: ITL p99 <= 150 ms and <= llama-server's", None))
        else:
            out.append((f"{name}: ITL p99 <= 150 ms and <= llama-server's: {p99:.1f} ms "
                        f"(llama-server {llama_p99:.1f} ms)", p99 <= 150 and p99 <= llama_p99))
    d50 = None if disagg is None else disagg["ttft_ms"]["p50"]
    c50 = None if colo is None else colo["ttft_ms"]["p50"]
    if d50 is None or c50 is None:
        out.append(("disaggregated TTFT p50 <= 1.5x colocated's", None))
    else:
        out.append((f"disaggregated TTFT p50 <= 1.5x colocated's: {d50:.0f} ms vs {1.5 * c50:.0f} ms "
                    f"(1.5 x {c50:.0f})", d50 <= 1.5 * c50))
    return out


def cmd_report(a):
    results = []
    for path in a.results:
        with open(path) as f:
            results.append(json.load(f))

    print("| server | concurrency | requests | failed | output tok/s | TTFT p50 ms | TTFT p99 ms "
          "| ITL p50 ms | ITL p99 ms | tok/chunk |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for l in r["levels"]:
            print(f"| {r['server']} | {l['concurrency']} | {l['requests']} | {l['failed']} "
                  f"| {l['output_tok_per_s']:.1f} | {fmt(l['ttft_ms']['p50'], 0)} | {fmt(l['ttft_ms']['p99'], 0)} "
                  f"| {fmt(l['itl_ms']['p50'])} | {fmt(l['itl_ms']['p99'])} "
                  f"| {fmt(l['tokens_per_text_event'], 2)} |")

    measured = set.intersection(*({l["concurrency"] for l in r["levels"]} for r in results)) if results else set()
    at = a.target_concurrency
    print()
    if at not in measured and measured:
        at = max(measured)
        print(f"Targets (set for concurrency {a.target_concurrency}, which this run did not measure; "
              f"shown at concurrency {at}):")
    else:
        print(f"Targets at concurrency {at}:")
    checked = targets(results, at)
    for desc, met in checked:
        print(f"- {desc} -> {'not measured' if met is None else 'met' if met else 'NOT met'}")

    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"results": results, "target_concurrency": at,
                       "targets": [{"target": d, "met": m} for d, m in checked]}, f, indent=2)
    return 1 if any(l["failed"] for r in results for l in r["levels"]) else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="measure one server")
    run.add_argument("--name", required=True)
    run.add_argument("--url", required=True, help="http://HOST:PORT of the OpenAI API")
    run.add_argument("--out", required=True, help="where the result JSON goes")
    run.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    run.add_argument("--requests-per-stream", type=int, default=3)
    run.add_argument("--output-tokens", type=int, default=64)
    run.add_argument("--prompt-words", type=int, default=180)
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--timeout-s", type=float, default=300, help="longest wait for any one read")

    rep = sub.add_parser("report", help="print the table and the targets")
    rep.add_argument("results", nargs="+")
    rep.add_argument("--json-out")
    rep.add_argument("--target-concurrency", type=int, default=16)

    a = p.parse_args()
    try:
        return cmd_run(a) if a.cmd == "run" else cmd_report(a)
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
