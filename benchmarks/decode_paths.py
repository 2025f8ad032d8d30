"""Single-sequence and 32-sequence decode speed of the bundled model on each decode path.

    .venv/bin/python benchmarks/decode_paths.py [--dtype float32|bfloat16] [--quantization int8|int4]

Prints output tok/s for one sequence (best of three runs) and 32 sequences on
the three paths a decode step can take, and their ratios:

- ``programs``: captured steps whose kernels run as native step programs,
  one parallel region per step (``runner/capture/step_program.py``; the default);
- ``replay``: the same traced steps run op by op from Python
  (``runner/capture/decode_graph.py``: every op a Python call), one parallel region per kernel;
- ``eager``: the model's forward, module by module (``enforce_eager``).
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
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    args = parser.parse_args()
    llm = LLM(max_model_len=512, dtype=args.dtype, quantization=args.quantization)
    runner = llm.llm_engine.model_runner
    captured = runner.captured_decode
    if captured is None or not captured.native_programs:
        raise SystemExit("decode steps are not captured as native programs here (pagedllm env says why)")

    def use(path: str) -> None:
        runner.captured_decode = None if path == "eager" else captured
        if path != "eager" and captured.native_programs != (path == "programs"):
            captured.reset(native_programs=path == "programs")  # captured again, lowered or not

    for num_seqs in (1, 32):
        figures = {}
        for path in ("programs", "replay", "eager"):
            use(path)
            tokens_per_second(llm, num_seqs, 4)  # warm-up: captures this path's first graphs
            runs = 3 if num_seqs == 1 else 1
            figures[path] = max(tokens_per_second(llm, num_seqs) for _ in range(runs))
        use("programs")
        print(f"{args.dtype} {args.quantization or ''} {num_seqs:>2} seq: " + ", ".join(
            f"{k} {v:.1f} tok/s" for k, v in figures.items()
        ) + f"; programs / replay {figures['programs'] / figures['replay']:.2f}, "
            f"programs / eager {figures['programs'] / figures['eager']:.2f}", flush=True)


if __name__ == "__main__":
    main()
