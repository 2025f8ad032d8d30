"""One conversation at a time: llama-server's n-gram speculative modes against ours, same prompts, one run.

After install.sh (llama-server from the llama.cpp vendored in llama-cpp-python's sdist):

    .venv/bin/python benchmarks/peers/llama_cpp/spec_peer.py [--rounds 2] [--max-tokens 200] \
        [--workloads code-edit,doc-qa,multi-turn-code,open-chat] [--model path/to/model.gguf]

The workloads are ``benchmarks/spec_decode.py``'s, imported from ``benchmarks/spec_workloads.py``:
code edits (five standard-library functions to repeat renamed), questions over a pasted document
(module docstrings, the BSD license; answers quote them), a multi-turn chat that revisits code an
earlier assistant turn holds, and open chat; ``--workloads`` picks some. ``--model`` is the GGUF
file both engines run (default: the bundled SmolLM2-135M-Instruct). For each llama-server
configuration (plain, then each ``--spec-type`` given) a server is started on it with one slot
(``-np 1``, 2 threads, no prompt cache between requests), warmed up, and sent every conversation
``--rounds`` times through /v1/chat/completions, greedy, ``max_tokens``; its decode rate is the
server's own ``timings.predicted_per_second`` (decode only, as ``llama-bench tg``), the best
round per prompt, summed as tokens over seconds. Ours: ``LLM`` plain and with each
``--speculative-config``, decode steps captured from the first (as llama-server's), the same
conversations, decode rate = output tokens after the first / time after the first token
(streamed through ``LLMEngine.step``).

Drafts are counted on each prompt's first round (a prompt the engine has not seen; llama.cpp's
``ngram-map-k``/``ngram-mod``/``ngram-cache`` and our ``suffix`` may learn from earlier requests):
``acceptance`` = accepted / drafted tokens, ``tokens_per_step`` = output tokens / target-model
decode steps (output tokens - accepted drafts, for both engines: llama-server reports no verify
step count), and for ours also ``mean_accepted_length`` (1 + accepted drafts per verify step,
vLLM's definition). Prints one JSON line per engine (its workloads inside) and the ratios against
llama-server plain and against its best n-gram mode, per workload.
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
from spec_workloads import WORKLOADS, workload_names, workloads  # noqa: E402  (benchmarks/spec_workloads.py)

SPEC_TYPES = ["ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache"]


def draft_figures(tokens: int, drafted: int, accepted: int, verify_steps: int | None = None) -> dict:
    """Acceptance figures of a workload's first rounds (see the module docstring)."""
    out = {"output_tokens": tokens, "draft_tokens": drafted, "accepted_tokens": accepted,
           "acceptance": round(accepted / drafted, 3) if drafted else None,
           "tokens_per_step": round(tokens / (tokens - accepted), 2) if tokens > accepted else None}
    if verify_steps is not None:
        out["verify_steps"] = verify_steps
        out["mean_accepted_length"] = round(1 + accepted / verify_steps, 2) if verify_steps else None
    return out


def llama_rates(binary: str, model: str, spec_type: str | None, rounds: int, max_tokens: int,
                names: list[str] | None) -> dict:
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
        for name, conversations in workloads(names).items():
            tokens, seconds = 0, 0.0
            first = [0, 0, 0]  # output tokens, drafted, accepted of the first rounds
            for conversation in conversations:
                best = None
                for round_ in range(rounds):
                    body = {**chat, "messages": conversation, "max_tokens": max_tokens}
                    r = post(base + "/v1/chat/completions", body, 600)
                    t = r.get("timings", {})
                    if round_ == 0:
                        first[0] += t["predicted_n"]
                        first[1] += t.get("draft_n", 0)
                        first[2] += t.get("draft_n_accepted", 0)
                    if best is None or t["predicted_ms"] < best["predicted_ms"]:
                        best = t
                tokens += best["predicted_n"]
                seconds += best["predicted_ms"] / 1000
            out[name] = {"tok_s": round(tokens / seconds, 1), **draft_figures(*first)}
        return out
    except Exception as e:  # noqa: BLE001 - report with the server's log
        fail(f"llama-server {spec_type or 'plain'}: {e}", log.name)
        raise
    finally:
        proc.terminate()
        proc.wait(30)


def our_rates(model: str, spec: dict | None, rounds: int, max_tokens: int, names: list[str] | None) -> dict:
    """Decode tok/s per workload of our engine (decode only: after the first token), captured from the start."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, max_model_len=4096, capture_min_decode_steps=0, speculative_config=spec)
    engine = llm.llm_engine
    tok = engine.tokenizer
    s = engine.speculator

    def decode_rate(conversation: list[dict]) -> tuple[int, float, int]:
        """Output tokens after the first, their seconds, all output tokens."""
        prompt = tok.apply_chat_template(conversation, add_generation_prompt=True)
        engine.add_request(engine.new_request_id(), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        first, n = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                if first is None and n:
                    first, first_n = time.perf_counter(), n
        return n - first_n, time.perf_counter() - first, n

    decode_rate([{"role": "user", "content": "Say hello."}])  # warm-up: the decode trace
    out = {}
    for name, conversations in workloads(names).items():
        tokens, seconds = 0, 0.0
        first = [0, 0, 0, 0]  # output tokens, drafted, accepted, verify steps of the first rounds
        for conversation in conversations:
            runs = []
            for round_ in range(rounds):
                before = (s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts) if s is not None else (0, 0, 0)
                runs.append(decode_rate(conversation))
                if round_ == 0:
                    first[0] += runs[0][2]
                    if s is not None:
                        after = (s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts)
                        for i in range(3):
                            first[1 + i] += after[i] - before[i]
            best = min(runs, key=lambda r: r[1] / max(r[0], 1))
            tokens += best[0]
            seconds += best[1]
        out[name] = {"tok_s": round(tokens / seconds, 1)}
        if s is not None:
            out[name].update(draft_figures(*first))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", default=DEFAULT_BIN)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--spec-type", action="append", default=None, help=f"llama-server modes (default {SPEC_TYPES})")
    p.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                   help="ours (repeatable); default ngram k=4")
    p.add_argument("--workloads", type=workload_names, default=None, metavar="NAMES",
                   help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)")
    p.add_argument("--model", default=None, help="a GGUF file, run by both engines (default: the bundled model)")
    args = p.parse_args()
    if not os.access(args.binary, os.X_OK):
        fail(f"no llama-server at {args.binary}: run benchmarks/peers/llama_cpp/install.sh")
    from pagedllm.loader import bundled_model_path

    model = args.model or bundled_model_path()
    ours = [None] + [json.loads(c) for c in args.speculative_config or ['{"method": "ngram", "num_speculative_tokens": 4}']]
    results = {}
    for spec in ours:
        results[f"pagedllm {spec['method'] if spec else 'plain'}"] = our_rates(
            model, spec, args.rounds, args.max_tokens, args.workloads)
    for spec_type in [None, *(args.spec_type or SPEC_TYPES)]:
        results[f"llama-server {spec_type or 'plain'}"] = llama_rates(
            args.binary, model, spec_type, args.rounds, args.max_tokens, args.workloads)
    for engine, rates in results.items():
        print(json.dumps({"engine": engine, **rates}))
    for name in workloads(args.workloads):
        plain = results["llama-server plain"][name]["tok_s"]
        best_llama = max(r[name]["tok_s"] for e, r in results.items() if e.startswith("llama-server"))
        for engine, rates in results.items():
            if engine.startswith("pagedllm"):
                r = rates[name]["tok_s"]
                print(f"{name}: {engine} {r} tok/s = {r / plain:.2f}x llama-server plain, "
                      f"{r / best_llama:.2f}x llama.cpp's best mode ({best_llama})")


if __name__ == "__main__":
    main()
