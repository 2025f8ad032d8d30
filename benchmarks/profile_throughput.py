"""Where the time of the throughput workload goes: engine phases and torch ops.

Runs the ``pagedllm bench throughput`` workload (smaller by default) twice:
once with wall-clock timers wrapped around each phase of a step (scheduling,
metadata building, the decoder, the LM head, sampling, logprobs, output
processing), once under ``torch.profiler`` for the top operators by self CPU
time. The wrapping is done here, from outside, so the engine carries no
profiling code.

    .venv/bin/python benchmarks/profile_throughput.py [--num-requests 32] [--quantization int8] \
        [--dtype bfloat16] [--layer-by-layer] [--kernel-timers]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workload import make_workload
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.quantization import packed_linear as pl
from pagedllm.runner import model_runner as mr


def _timed(table: dict, name: str, fn):  # noqa: ANN001, ANN202
    def wrapper(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            table[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--linear-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-torch-profile", action="store_true")
    p.add_argument("--layer-by-layer", action="store_true",
                   help="turn captured decode steps off: every step runs the model layer by layer")
    p.add_argument("--kernel-timers", action="store_true",
                   help="also time each linear-layer and elementwise kernel call (with its Python wrapper)")
    args = p.parse_args()

    workload = make_workload(args.num_requests, args.min_len, args.max_len, 1234)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    llm = LLM(
        attention_backend=args.attention_backend, quantization=args.quantization, linear_backend=args.linear_backend,
        kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
    )
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    if args.layer_by_layer:
        runner.captured_decode = None

    phases: dict[str, float] = defaultdict(float)
    model = runner.model
    engine.scheduler.schedule = _timed(phases, "schedule", engine.scheduler.schedule)
    engine.scheduler.update = _timed(phases, "scheduler update", engine.scheduler.update)
    runner.prepare = _timed(phases, "prepare (ids, positions, slot mapping, block tables)", runner.prepare)
    runner.copy_blocks = _timed(phases, "copy-on-write block copies", runner.copy_blocks)
    model.forward = _timed(phases, "decoder layers (forward), less attention", model.forward)  # prefills, mixed steps
    backend = runner.backend
    backend.attend = _timed(phases, f"attention ({backend.name})", backend.attend)
    if hasattr(backend, "_decodes"):  # the share of decodes within attention
        backend._decodes = _timed(phases, "  of which decode attention", backend._decodes)
    # (module, name, original) of every patch below that outlives this run, undone before the torch profile
    patched: list[tuple[object, str, object]] = []
    if args.kernel_timers:  # reported as "  of which ...": the linears include the LM head's
        for fn_name in ("packed_linear", "packed_linear_bf16"):
            patched.append((pl, fn_name, getattr(pl, fn_name)))
            setattr(pl, fn_name, _timed(phases, "  of which linear kernels (incl. lm_head)", getattr(pl, fn_name)))
        for op in ("add_rms_norm", "qk_norm_rope_", "silu_mul"):
            patched.append((NativeOps, op, getattr(NativeOps, op)))
            setattr(NativeOps, op, _timed(phases, "  of which norms, RoPE, SiLU", getattr(NativeOps, op)))
    if runner.captured_decode is not None:  # decode steps replay graphs of the model's forward
        captured = runner.captured_decode

        class _TimedCaptured:
            accepts = staticmethod(captured.accepts)
            __call__ = staticmethod(_timed(phases, "captured decode steps (native step programs)", captured))

        runner.captured_decode = _TimedCaptured()
    model.compute_logits = _timed(phases, "lm_head (sampling rows only)", model.compute_logits)
    runner.sampler = _timed(phases, "sampler", runner.sampler)
    runner._sampling_tensors = _timed(phases, "sampling tensors", runner._sampling_tensors)
    mr.token_logprobs = _timed(phases, "logprobs of sampled tokens", mr.token_logprobs)
    mr.logit_stats = _timed(phases, "logit stats (argmax + logsumexp)", mr.logit_stats)
    engine.output_processor.append_sample = _timed(phases, "output: append, detokenize, stops", engine.output_processor.append_sample)
    engine.output_processor.make_output = _timed(phases, "output: RequestOutput objects", engine.output_processor.make_output)
    steps = 0
    step = engine.step

    def counted_step():  # noqa: ANN202
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.num_requests} requests, {num_out} output tokens, {steps} steps, {wall:.2f}s wall, "
          f"{num_out / wall:.1f} output tok/s")
    # attention runs inside the forward pass: report the forward without it
    phases["decoder layers (forward), less attention"] -= phases[f"attention ({backend.name})"]
    print(f"{'phase':<56} {'seconds':>8} {'% wall':>7} {'ms/step':>8}")
    for name, sec in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"{name:<56} {sec:8.2f} {100 * sec / wall:6.1f}% {1000 * sec / steps:8.2f}")
    rest = wall - sum(v for k, v in phases.items() if not k.startswith("  "))
    print(f"{'other (engine loop, LLM.generate, tokenizer)':<56} {rest:8.2f} {100 * rest / wall:6.1f}% {1000 * rest / steps:8.2f}")

    if args.no_torch_profile:
        return
    # second run, torch ops only (the profiler's own overhead inflates wall time)
    del model.forward  # back to the class's method
    del backend.attend
    if "_decodes" in vars(backend):
        del backend._decodes
    if runner.captured_decode is not None:
        runner.captured_decode = captured
    for owner, name, original in patched:
        setattr(owner, name, original)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))


if __name__ == "__main__":
    main()
