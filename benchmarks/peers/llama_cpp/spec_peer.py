"""One conversation at a time: llama-server's n-gram speculative modes against ours, same prompts, one run.

After install.sh (llama-server from the llama.cpp vendored in llama-cpp-python's sdist):

    .venv/bin/python benchmarks/peers/llama_cpp/spec_peer.py [--rounds 2] [--max-tokens 200]

The workloads are ``benchmarks/spec_decode.py``'s (five standard-library functions to repeat
renamed; two open chats). For each llama-server configuration (plain, then each ``--spec-type``
given) a server is started on the bundled GGUF with one slot (``-np 1``, 2 threads, no prompt
cache between requests), warmed up, and sent every conversation ``--rounds`` times through
/v1/chat/completions, greedy, ``max_tokens``; its decode rate is the server's own
``timings.predicted_per_second`` (decode only, as ``llama-bench tg``), the best round per
prompt, summed as tokens over seconds. Ours: ``LLM`` plain and with each
``--speculative-config``, decode steps captured from the first (as llama-server's), the same
conversations, decode rate = output tokens after the first / time after the first token
(streamed through ``LLMEngine.step``). Prints one line per engine and workload, and the
ratios against llama-server plain and against its best n-gram mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_server import DEFAULT_BIN, fail, free_port, post, wait_healthy  # noqa: E402
from spec_decode import workloads  # noqa: E402  (benchmarks/spec_decode.py)

SPEC_TYPES = ["ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache"]


def llama_rates(binary: str, model: str, spec_type: str | None, rounds: int, max_tokens: int) -> dict:
    """Decode tok/s per workload (and draft counts) of one llama-server configuration."""
    port = free_port()
    cmd = [binary, "-m", model, "--port", str(port), "-t", "2", "-np", "1", "-c", "4096", "--no-warmup"]
    if spec_type:
        cmd += ["--spec-type", spec_type]
    log = tempfile.NamedTemporaryFile(prefix="llama-spec-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 120, log.name)
        chat = {"temperature": 0, "max_tokens": 16, "cache_prompt": False,
                "messages": [{"role": "user", "content": "Say hello."}]}
        post(base + "/v1/chat/completions", chat, 300)  # warm-up
        out = {}
        for name, conversations in workloads().items():
            tokens, seconds, drafted, accepted = 0, 0.0, 0, 0
            for conversation in conversations:
                best = None
                for _ in range(rounds):
                    body = {**chat, "messages": conversation, "max_tokens": max_tokens}
                    r = post(base + "/v1/chat/completions", body, 600)
                    t = r.get("timings", {})
                    if best is None or t["predicted_ms"] < best["predicted_ms"]:
                        best = t
                tokens += best["predicted_n"]
                seconds += best["predicted_ms"] / 1000
                drafted += best.get("draft_n", 0)
                accepted += best.get("draft_n_accepted", 0)
            out[name] = {"tok_s": round(tokens / seconds, 1), "draft_tokens": drafted, "accepted_tokens": accepted}
        return out
    except Exception as e:  # noqa: BLE001 - report with the server's log
        fail(f"llama-server {spec_type or 'plain'}: {e}", log.name)
        raise
    finally:
        proc.terminate()
        proc.wait(30)


def our_rates(spec: dict | None, rounds: int, max_tokens: int) -> dict:
    """Decode tok/s per workload of our engine (decode only: after the first token), captured from the start."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(max_model_len=4096, capture_min_decode_steps=0, speculative_config=spec)
    engine = llm.llm_engine
    tok = engine.tokenizer

    def decode_rate(conversation: list[dict]) -> tuple[int, float]:
        prompt = tok.apply_chat_template(conversation, add_generation_prompt=True)
        engine.add_request(engine.new_request_id(), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        first, n = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                if first is None and n:
                    first, first_n = time.perf_counter(), n
        return n - first_n, time.perf_counter() - first

    decode_rate([{"role": "user", "content": "Say hello."}])  # warm-up: the decode trace
    out = {}
    for name, conversations in workloads().items():
        tokens, seconds = 0, 0.0
        for conversation in conversations:
            best = min((decode_rate(conversation) for _ in range(rounds)), key=lambda r: r[1] / max(r[0], 1))
            tokens += best[0]
            seconds += best[1]
        out[name] = {"tok_s": round(tokens / seconds, 1)}
    s = engine.speculator
    if s is not None:
        out["spec_decode"] = {"draft_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_tokens}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", default=DEFAULT_BIN)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--spec-type", action="append", default=None, help=f"llama-server modes (default {SPEC_TYPES})")
    p.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                   help="ours (repeatable); default ngram k=4")
    args = p.parse_args()
    if not os.access(args.binary, os.X_OK):
        fail(f"no llama-server at {args.binary}: run benchmarks/peers/llama_cpp/install.sh")
    from pagedllm.loader import bundled_model_path

    model = bundled_model_path()
    ours = [None] + [json.loads(c) for c in args.speculative_config or ['{"method": "ngram", "num_speculative_tokens": 4}']]
    results = {}
    for spec in ours:
        results[f"pagedllm {spec['method'] if spec else 'plain'}"] = our_rates(spec, args.rounds, args.max_tokens)
    for spec_type in [None, *(args.spec_type or SPEC_TYPES)]:
        results[f"llama-server {spec_type or 'plain'}"] = llama_rates(
            args.binary, model, spec_type, args.rounds, args.max_tokens)
    for engine, rates in results.items():
        print(json.dumps({"engine": engine, **rates}))
    for name in workloads():
        plain = results["llama-server plain"][name]["tok_s"]
        best_llama = max(r[name]["tok_s"] for e, r in results.items() if e.startswith("llama-server"))
        for engine, rates in results.items():
            if engine.startswith("pagedllm"):
                r = rates[name]["tok_s"]
                print(f"{name}: {engine} {r} tok/s = {r / plain:.2f}x llama-server plain, "
                      f"{r / best_llama:.2f}x llama.cpp's best mode ({best_llama})")


if __name__ == "__main__":
    main()
