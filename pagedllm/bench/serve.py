"""``pagedllm bench serve``: streaming clients against a running server, like vLLM's serving benchmark.

Random-token prompts (token-id lists, so no tokenizer is needed here) are sent
as streaming ``/v1/completions`` with ``ignore_eos`` and greedy sampling, so
each request produces exactly its output length. ``--mix`` mixes in requests
constrained to a JSON schema, chats with tools (``tool_choice="required"``),
which end when their output is complete, and long prompts (``long``: plain
completions of ``--long-input-len`` prompt tokens and ``--long-output-len``
output tokens, the prompts that stall other streams while they prefill);
the report then breaks TTFT, TPOT and ITL down by kind. Arrivals are all at once
(``--request-rate inf``) or a Poisson process; ``--max-concurrency`` caps the
requests in flight (later arrivals wait for a free slot, and their clock starts
when they are sent). Per request: TTFT (send to first text), TPOT ((latency -
TTFT) / (output tokens - 1)), ITL (gaps between streamed chunks) and end-to-end
latency; mean, median and p99 of each in milliseconds.

Only the standard library talks HTTP here, so the benchmark needs nothing the
package does not already install.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import http.client
import json
import math
import os
import platform
import random
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.bench.workload import TOKEN_ID_HIGH, TOKEN_ID_LOW


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench serve`` flags."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (loopback by default)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)] (default 0: fixed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    p.add_argument("--mix", default="plain",
                   help="request kinds and weights, e.g. 'plain:2,json:1,tools:1,long:1': plain completions, "
                        "completions constrained to a JSON schema, chat with tools and tool_choice 'required', "
                        "long-prompt completions (default: plain)")
    p.add_argument("--long-input-len", type=int, default=4000, help="prompt tokens of a 'long' request")
    p.add_argument("--long-output-len", type=int, default=1, help="output tokens of a 'long' request")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")


KINDS = ("plain", "json", "tools", "long")
# what the "json" kind's outputs must follow: nested, enums, bounded numbers
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                      "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
BENCH_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 32}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query"], "additionalProperties": False}}},
]


@dataclass(frozen=True)
class ServeRequest:
    """One benchmark request: prompt token ids, the output length, its kind.

    ``plain`` and ``long`` requests produce exactly ``output_len`` tokens (``ignore_eos``);
    ``json`` and ``tools`` ones end when their constrained output is complete
    (at most ``output_len`` tokens). A ``tools`` request is a chat whose user
    message is the prompt's text.
    """

    prompt_token_ids: list[int]
    output_len: int
    kind: str = "plain"
    prompt_text: str = ""


@dataclass
class RequestResult:
    """What one streamed request measured (seconds)."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    kind: str = "plain"


def parse_mix(mix: str) -> dict[str, float]:
    """``"plain:2,json:1"`` -> {kind: weight}; ValueError for an unknown kind or a bad weight."""
    weights: dict[str, float] = {}
    for part in mix.split(","):
        kind, _, weight = part.strip().partition(":")
        if kind not in KINDS:
            raise ValueError(f"--mix: unknown request kind {kind!r}; known: {', '.join(KINDS)}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"--mix: the weight of {kind} must be a number, got {weight!r}") from None
        if not w > 0 or math.isinf(w):
            raise ValueError(f"--mix: the weight of {kind} must be a positive number, got {weight!r}")
        weights[kind] = w
    return weights


def make_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int, mix: dict[str, float] | None = None,
    long_lens: tuple[int, int] = (4000, 1),
) -> list[ServeRequest]:
    """Random-token requests of the ``mix``'s kinds; the same arguments give the same requests.

    ``long_lens``: the (prompt, output) tokens of a ``long`` request, fixed.
    """
    if num < 1 or input_len < 1 or output_len < 1 or min(long_lens) < 1:
        raise ValueError("need --num-prompts, --input-len, --output-len, --long-input-len and --long-output-len >= 1")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    mix = mix or {"plain": 1.0}
    kinds, weights = list(mix), list(mix.values())

    def draw(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - range_ratio))), int(n * (1 + range_ratio)))

    out = []
    for _ in range(num):
        n_in, n_out = draw(input_len), draw(output_len)
        ids = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(n_in)]
        kind = rng.choices(kinds, weights)[0]
        if kind == "long":  # drawn after the kind, so the other kinds' requests stay as they were
            n_out = long_lens[1]
            ids = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(long_lens[0])]
        out.append(ServeRequest(ids, n_out, kind))
    return out


def _request_body(model: str, req: ServeRequest) -> tuple[str, dict[str, Any]]:
    """(route, JSON body) of one streamed benchmark request."""
    common = {"model": model, "max_tokens": req.output_len, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if req.kind in ("plain", "long"):
        return "/v1/completions", {**common, "prompt": req.prompt_token_ids, "ignore_eos": True}
    if req.kind == "json":
        return "/v1/completions", {**common, "prompt": req.prompt_token_ids,
                                   "structured_outputs": {"json": BENCH_SCHEMA}}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": req.prompt_text}],
                                    "tools": BENCH_TOOLS, "tool_choice": "required"}


def _has_output(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries new output (text, content or a call's pieces)."""
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls"))


class _Client:
    """HTTP/1.1 to the server with the standard library, one connection per request."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"--base-url must be http://HOST:PORT, got {base_url!r}")
        self.host = url.hostname
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get_json(self, path: str) -> Any:
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: {resp.status} {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def stream_completion(self, model: str, req: ServeRequest) -> RequestResult:
        """Send one streaming completion; time its chunks."""
        result = RequestResult(prompt_tokens=len(req.prompt_token_ids), kind=req.kind)
        route, payload = _request_body(model, req)
        body = json.dumps(payload)
        conn = self.connect()
        start = time.perf_counter()
        last = start
        try:
            conn.request("POST", self.prefix + route, body=body, headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                return result
            done = False
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return result
                now = time.perf_counter()
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                if any(_has_output(c) for c in event.get("choices", [])):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
            result.latency = time.perf_counter() - start
            if not done:
                result.error = "the stream ended without [DONE]"
            elif req.kind in ("plain", "long") and result.output_tokens != req.output_len:
                result.error = f"got {result.output_tokens} tokens, asked for {req.output_len}"
            elif not 1 <= result.output_tokens <= req.output_len:
                result.error = f"got {result.output_tokens} tokens, asked for at most {req.output_len}"
            else:
                result.success = True
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            result.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        return result


def _with_text(client: _Client, req: ServeRequest) -> ServeRequest:
    """A ``tools`` request gets its prompt's text (the server's ``/detokenize``) for its user message."""
    if req.kind != "tools":
        return req
    conn = client.connect()
    try:
        conn.request("POST", client.prefix + "/detokenize", body=json.dumps({"tokens": req.prompt_token_ids}),
                     headers=client.headers)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise ValueError(f"/detokenize: {resp.status} {body[:300]!r}")
        return dataclasses.replace(req, prompt_text=json.loads(body)["prompt"])
    finally:
        conn.close()


def _arrival_times(num: int, rate: float, rng: random.Random) -> list[float]:
    """Offsets (s) at which requests arrive: all at 0, or a Poisson process of ``rate``."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _stats(values_s: list[float]) -> dict[str, float]:
    """Mean, median and p99 in milliseconds (0 when there is nothing to measure)."""
    if not values_s:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values_s) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM's serving figures from per-request results."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    by_kind = {
        kind: {
            "completed": len(rs),
            "mean_prompt_tokens": sum(r.prompt_tokens for r in rs) / len(rs),
            "mean_output_tokens": sum(r.output_tokens for r in rs) / len(rs),
            "ttft_ms": _stats([r.ttft for r in rs]),
            "tpot_ms": _stats([(r.latency - r.ttft) / (r.output_tokens - 1) for r in rs if r.output_tokens > 1]),
            "itl_ms": _stats([x for r in rs for x in r.itl]),
        }
        for kind in KINDS
        if (rs := [r for r in ok if r.kind == kind])
    }
    return {
        "by_kind": by_kind,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
    }


def _print_report(res: dict[str, Any]) -> None:
    def row(name: str, value: Any) -> None:
        print(f"{name:<40}{value:<10.2f}" if isinstance(value, float) else f"{name:<40}{value:<10}")

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    row("Maximum request concurrency:", res["max_concurrency"] or "none")
    row("Request rate (req/s):", res["request_rate"])
    row("Benchmark duration (s):", res["duration_s"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for key, title, short in (
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-token Latency", "ITL"),
        ("e2el_ms", "End-to-end Latency", "E2EL"),
    ):
        print("{s:{c}^50}".format(s=f" {title} ", c="-"))
        row(f"Mean {short} (ms):", res[key]["mean"])
        row(f"Median {short} (ms):", res[key]["median"])
        row(f"P99 {short} (ms):", res[key]["p99"])
    if len(res["by_kind"]) > 1:
        print("{s:{c}^50}".format(s=" By request kind (ms) ", c="-"))
        for kind, k in res["by_kind"].items():
            print(f"{kind} ({k['completed']} req, {k['mean_prompt_tokens']:.0f}+{k['mean_output_tokens']:.0f} tok):")
            for key, short in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
                row(f"  {short} mean / median / p99:",
                    f"{k[key]['mean']:.1f} / {k[key]['median']:.1f} / {k[key]['p99']:.1f}")
    print("=" * 50)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark against ``args.base_url``; print the report and return the figures."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    client = _Client(args.base_url, args.api_key, args.timeout)
    try:
        models = client.get_json("/v1/models")
    except (OSError, http.client.HTTPException) as e:
        raise ValueError(f"no server answers at {args.base_url}: {e}") from e
    except RuntimeError as e:
        raise ValueError(str(e)) from e
    model = args.model or models["data"][0]["id"]
    requests = make_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed, parse_mix(args.mix),
        (args.long_input_len, args.long_output_len),
    )
    requests = [_with_text(client, r) for r in requests]
    arrivals = _arrival_times(len(requests), args.request_rate, random.Random(args.seed + 1))

    # warm-up, not counted: the first request pays for allocator and thread start-up
    # (half a block of the first prompt: nothing the prefix cache could hand a measured request)
    warm = client.stream_completion(model, ServeRequest(requests[0].prompt_token_ids[:8], 4))
    if not warm.success:
        raise ValueError(f"the warm-up request failed: {warm.error}")

    workers = args.max_concurrency or len(requests)
    results: list[RequestResult | None] = [None] * len(requests)
    lock = threading.Lock()
    done = 0

    def one(i: int) -> None:
        nonlocal done
        results[i] = client.stream_completion(model, requests[i])
        with lock:
            done += 1

    if not args.json:
        print(f"{len(requests)} requests to {args.base_url} ({model}), rate {args.request_rate}, "
              f"max concurrency {args.max_concurrency or 'none'}", flush=True)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = []
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, i))
        for f in futures:
            f.result()
    duration = time.perf_counter() - start

    final = [r if r is not None else RequestResult(error="not run") for r in results]
    res = summarize(final, duration)
    res.update(
        model=model, num_prompts=len(requests), request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf",
        max_concurrency=args.max_concurrency, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, mix=args.mix, machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
    )
    errors = sorted({r.error for r in final if not r.success})
    res["errors"] = errors[:5]
    if not args.json:
        _print_report(res)
        for e in errors[:5]:
            print(f"error: {e}")
    else:
        print(json.dumps(res))
    return res
