"""Speculative decoding (ngram, suffix) against plain decoding, one conversation at a time.

Workloads from text nobody here wrote: code edits on functions of Python's own standard library
("repeat this function with a name changed", where the answer copies the prompt) and open-ended
chat (nothing to copy). Each prompt runs greedy through the plain engine and one engine per
``--speculative-config`` (default: ngram), alternated, and prints output tokens/s, the ratio, the
drafts proposed and accepted, and the accepted drafts per verify step. All engines must emit the
same tokens (checked: speculation is lossless).

Suffix decoding remembers earlier outputs (its global tree), so a prompt's second round finds its
own first output there: acceptance is reported for the first round (each prompt new, the tree
holding the earlier prompts' outputs) and for the later rounds (a repeated request) apart.

    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode.py [--rounds 2] [--max-tokens 200] [--json] \
        [--speculative-config '{"method": "ngram"}' --speculative-config '{"method": "suffix"}']
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


def engine_names(configs: list[dict]) -> list[str]:
    """A name per speculative config: its method, numbered when two share one."""
    methods = [c["method"] for c in configs]
    return [m if methods.count(m) == 1 else f"{m}#{i}" for i, m in enumerate(methods)]


def acceptance(counts: list[int]) -> dict:
    """Figures from [draft tokens, accepted tokens, verify steps]."""
    drafted, accepted, steps = counts
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "accepted_per_step": round(accepted / steps, 2) if steps else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="alternated runs of each prompt per engine")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="k of the default ngram config (without --speculative-config)")
    p.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                   help="an engine's config (repeatable: one engine each); default ngram with k")
    p.add_argument("--capture-min-decode-steps", type=int, default=512,
                   help="as the engine's flag (default 512, the engine's: short requests decode eager; 0: "
                        "plain decode steps captured from the first)")
    p.add_argument("--json", action="store_true", help="one JSON line per workload")
    args = p.parse_args()
    configs = [json.loads(c) for c in args.speculative_config or []] or [
        {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}]
    common = {"max_model_len": 2048, "capture_min_decode_steps": args.capture_min_decode_steps}
    engines = {"plain": LLM(**common)}
    for e, config in zip(engine_names(configs), configs):
        engines[e] = LLM(**common, speculative_config=config)
    spec_engines = [e for e in engines if e != "plain"]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in engines.values():  # untimed: the decode trace (capture) and first-call costs
        run(llm, [{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=16))
    for name, conversations in workloads().items():
        totals = {e: [0, 0.0] for e in engines}  # tokens, seconds (best round per prompt)
        # seconds of the first round: a prompt the engine has not seen (suffix's global tree learns outputs)
        first_seconds = {e: 0.0 for e in engines}
        # per engine: [draft tokens, accepted tokens, verify steps] of the first round, of the later ones
        counts = {e: [[0, 0, 0], [0, 0, 0]] for e in spec_engines}
        for conversation in conversations:
            best: dict[str, float] = {}
            tokens: dict[str, list[int]] = {}
            for round_ in range(args.rounds):
                for e, llm in engines.items():
                    steps_before = llm.llm_engine.speculator.num_drafts if e != "plain" else 0
                    ids, seconds, metrics = run(llm, conversation, params)
                    best[e] = min(best.get(e, seconds), seconds)
                    if round_ == 0:
                        first_seconds[e] += seconds
                    if e in tokens and tokens[e] != ids:
                        raise SystemExit(f"{e}: greedy output changed between rounds")
                    tokens[e] = ids
                    if e != "plain":
                        c = counts[e][min(round_, 1)]
                        c[0] += metrics.get("spec_decode_num_draft_tokens", 0)
                        c[1] += metrics.get("spec_decode_num_accepted_tokens", 0)
                        c[2] += llm.llm_engine.speculator.num_drafts - steps_before
            for e in spec_engines:
                if tokens["plain"] != tokens[e]:
                    raise SystemExit(f"{name}: {e} changed the greedy output")
            for e in engines:
                totals[e][0] += len(tokens[e])
                totals[e][1] += best[e]
        rates = {e: totals[e][0] / totals[e][1] for e in engines}
        first = {e: totals[e][0] / first_seconds[e] for e in engines}
        row = {"workload": name, "prompts": len(conversations), "plain_tok_s": round(rates["plain"], 1)}
        for e in spec_engines:
            row[e] = {"tok_s": round(rates[e], 1), "ratio": round(rates[e] / rates["plain"], 3),
                      "first_round_ratio": round(first[e] / first["plain"], 3),
                      "first_round": acceptance(counts[e][0]), "later_rounds": acceptance(counts[e][1])}
        if args.json:
            print(json.dumps(row))
            continue
        print(f"{name}: plain {row['plain_tok_s']} tok/s")
        for e in spec_engines:
            first, later = row[e]["first_round"], row[e]["later_rounds"]
            print(f"  {e}: {row[e]['tok_s']} tok/s ({row[e]['ratio']}x best round, {row[e]['first_round_ratio']}x "
                  f"first round); first round: accepted "
                  f"{first['accepted_tokens']}/{first['draft_tokens']} ({first['acceptance']}), "
                  f"{first['accepted_per_step']} per verify step; later rounds: "
                  f"{later['accepted_tokens']}/{later['draft_tokens']} ({later['acceptance']}), "
                  f"{later['accepted_per_step']} per step")


if __name__ == "__main__":
    main()
