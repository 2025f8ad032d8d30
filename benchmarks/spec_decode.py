"""Speculative decoding (ngram, suffix) against plain decoding, one conversation at a time.

Workloads from text nobody here wrote (``benchmarks/spec_workloads.py``, shared with the llama.cpp
peer ``benchmarks/peers/llama_cpp/spec_peer.py``): ``code-edit`` (five functions of Python's own
standard library, "repeat this function renamed": the answer copies the prompt), ``doc-qa`` (a
module docstring or a license text pasted, then a question whose answer quotes it),
``multi-turn-code`` (an earlier assistant turn holds a standard-library function, the last turn
asks to change it: type hints, None handling, ...) and ``open-chat`` (nothing to copy);
``--workloads`` picks some. Each prompt runs greedy through the plain engine and one engine per
``--speculative-config`` (default: ngram), alternated, and prints output tokens/s, the ratio, the
drafts proposed and accepted (the acceptance rate), the accepted drafts per verify step and the
mean accepted length (1 + that, vLLM's definition). All engines must emit the same tokens
(checked: speculation is lossless). ``--model`` runs another GGUF file or Hugging Face folder
(default: the bundled SmolLM2-135M-Instruct).

Suffix decoding remembers earlier outputs (its global tree), so a prompt's second round finds its
own first output there: acceptance is reported for the first round (each prompt new, the tree
holding the earlier prompts' outputs) and for the later rounds (a repeated request) apart.

    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode.py [--rounds 2] [--max-tokens 200] [--json] \
        [--workloads code-edit,doc-qa] [--model path/to/model.gguf] \
        [--speculative-config '{"method": "ngram"}' --speculative-config '{"method": "suffix"}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_workloads import WORKLOADS, workload_names, workloads  # noqa: E402  (benchmarks/spec_workloads.py)

from pagedllm import LLM, SamplingParams  # noqa: E402


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
    return {"draft_tokens": drafted, "accepted_tokens": accepted, "verify_steps": steps,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "accepted_per_step": round(accepted / steps, 2) if steps else None,
            "mean_accepted_length": round(1 + accepted / steps, 2) if steps else None}


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
    p.add_argument("--workloads", type=workload_names, default=None, metavar="NAMES",
                   help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)")
    p.add_argument("--model", default=None,
                   help="a GGUF file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    args = p.parse_args()
    configs = [json.loads(c) for c in args.speculative_config or []] or [
        {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}]
    common = {"max_model_len": 2048, "capture_min_decode_steps": args.capture_min_decode_steps,
              "tokenizer": args.tokenizer}
    engines = {"plain": LLM(args.model, **common)}
    for e, config in zip(engine_names(configs), configs):
        engines[e] = LLM(args.model, **common, speculative_config=config)
    spec_engines = [e for e in engines if e != "plain"]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in engines.values():  # untimed: the decode trace (capture) and first-call costs
        run(llm, [{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=16))
    for name, conversations in workloads(args.workloads).items():
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
                  f"{first['accepted_per_step']} per verify step (mean accepted length "
                  f"{first['mean_accepted_length']}); later rounds: "
                  f"{later['accepted_tokens']}/{later['draft_tokens']} ({later['acceptance']}), "
                  f"{later['accepted_per_step']} per step (length {later['mean_accepted_length']})")


if __name__ == "__main__":
    main()
