"""Single-sequence and 32-sequence decode speed of the bundled model, with the fused decode step and without.

    .venv/bin/python benchmarks/decode_paths.py [--dtype float32|bfloat16] [--quantization int8]

Prints output tok/s for one sequence (best of three runs) and 32 sequences,
each with the runner's fused decode step (``runner/fused_decode.py``) and
with it switched off (the layer-by-layer path through the same ops), and
their ratio: what the second, native copy of the decoder is still worth.
"""

from __future__ import annotations

import argparse
import time

from pagedllm import LLM, SamplingParams


def tokens_per_second(llm: LLM, num_seqs: int, max_tokens: int = 96) -> float:
    """Output tok/s of ``num_seqs`` greedy sequences of ``max_tokens`` tokens each."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [f"Tell me a story about number {i}." for i in range(num_seqs)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["int8"])
    args = parser.parse_args()
    llm = LLM(max_model_len=512, dtype=args.dtype, quantization=args.quantization)
    runner = llm.llm_engine.model_runner
    fused = runner.fused_decode
    tokens_per_second(llm, 1, 4)  # warm-up
    for num_seqs in (1, 32):
        figures = {}
        for name, step in (("fused", fused), ("layer by layer", None)):
            runner.fused_decode = step
            runs = 3 if num_seqs == 1 else 1
            figures[name] = max(tokens_per_second(llm, num_seqs) for _ in range(runs))
        runner.fused_decode = fused
        ratio = figures["fused"] / figures["layer by layer"]
        print(f"{args.dtype} {args.quantization or ''} {num_seqs:>2} seq: fused {figures['fused']:.1f} tok/s, "
              f"layer by layer {figures['layer by layer']:.1f} tok/s, fused / layer {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
