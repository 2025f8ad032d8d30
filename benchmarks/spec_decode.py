"""Speculative decoding (ngram) against plain decoding, one conversation at a time.

Workloads from text nobody here wrote: code edits on functions of Python's own standard library
("repeat this function with a name changed", where the answer copies the prompt) and open-ended
chat (nothing to copy). Each prompt runs greedy through two engines, plain and with
``--speculative-config``, alternated, and prints output tokens/s, the ratio, and the drafts proposed
and accepted. Both engines must emit the same tokens (checked: speculation is lossless).

    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode.py [--rounds 2] [--max-tokens 200] [--json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import textwrap
import time

from pagedllm import LLM, SamplingParams

CODE_FUNCTIONS = [textwrap.dedent, textwrap.indent, inspect.cleandoc, statistics.median, json.dumps]
CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python? Explain briefly.",
]


def workloads() -> dict[str, list[list[dict]]]:
    """Chat conversations by workload name."""
    edits = []
    for fn in CODE_FUNCTIONS:
        source = textwrap.dedent(inspect.getsource(fn))
        if len(source) > 1500:  # keep each prompt a few hundred tokens
            source = source[:1500].rsplit("\n", 1)[0]
        edits.append([{"role": "user", "content": f"Repeat this Python function exactly, but rename it to "
                       f"`{fn.__name__}_v2`:\n\n```python\n{source}\n```"}])
    chat = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    return {"code-edit": edits, "open-chat": chat}


def run(llm: LLM, conversation: list[dict], params: SamplingParams) -> tuple[list[int], float, dict]:
    """One conversation alone: its output token ids, seconds, and the request's metrics."""
    start = time.perf_counter()
    out = llm.chat(conversation, params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), time.perf_counter() - start, dict(out.metrics or {})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="alternated runs of each prompt per engine")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--capture-min-decode-steps", type=int, default=512,
                   help="as the engine's flag (default 512, the engine's: short requests decode eager; 0: "
                        "plain decode steps captured from the first)")
    p.add_argument("--json", action="store_true", help="one JSON line per workload")
    args = p.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    common = {"max_model_len": 2048, "capture_min_decode_steps": args.capture_min_decode_steps}
    engines = {"plain": LLM(**common), "ngram": LLM(**common, speculative_config=spec)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for name, conversations in workloads().items():
        totals = {e: [0, 0.0] for e in engines}  # tokens, seconds (best round per prompt)
        drafted = accepted = 0
        for conversation in conversations:
            best: dict[str, float] = {}
            tokens: dict[str, list[int]] = {}
            for _ in range(args.rounds):
                for e, llm in engines.items():
                    ids, seconds, metrics = run(llm, conversation, params)
                    best[e] = min(best.get(e, seconds), seconds)
                    if e in tokens and tokens[e] != ids:
                        raise SystemExit(f"{e}: greedy output changed between rounds")
                    tokens[e] = ids
                    if e == "ngram":
                        drafted += metrics.get("spec_decode_num_draft_tokens", 0)
                        accepted += metrics.get("spec_decode_num_accepted_tokens", 0)
            if tokens["plain"] != tokens["ngram"]:
                raise SystemExit(f"{name}: speculation changed the greedy output")
            for e in engines:
                totals[e][0] += len(tokens[e])
                totals[e][1] += best[e]
        rates = {e: totals[e][0] / totals[e][1] for e in engines}
        row = {"workload": name, "prompts": len(conversations), "plain_tok_s": round(rates["plain"], 1),
               "ngram_tok_s": round(rates["ngram"], 1), "ratio": round(rates["ngram"] / rates["plain"], 3),
               "draft_tokens": drafted, "accepted_tokens": accepted,
               "acceptance": round(accepted / drafted, 3) if drafted else None}
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{name}: plain {row['plain_tok_s']} tok/s, ngram {row['ngram_tok_s']} tok/s "
                  f"({row['ratio']}x), drafts {drafted}, accepted {accepted} ({row['acceptance']})")


if __name__ == "__main__":
    main()
