"""Transformers as a peer on the throughput workload, run in the same process.

Two ways a transformers user would batch the 64 requests:

- ``padded``: ``model.generate`` on static batches (16 requests by default),
  prompts left-padded to the batch's longest, every row generating the
  batch's longest output. Only each request's own output length counts as
  useful tokens; the rest is the price of static batching.
- ``continuous``: transformers' own continuous batching (the manager behind
  ``generate_batch``), every request with its own ``max_new_tokens``.

Both run greedy in float32 on the same weights (the GGUF read and
dequantized by transformers) with EOS ignored, like our engine's run.
"""

from __future__ import annotations

import logging
import os
import time

from pagedllm.bench.workload import BenchRequest, throughput_record


def load_model(model_path: str):  # noqa: ANN201
    """The model as transformers loads it, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _result(name: str, workload: list[BenchRequest], elapsed: float, extra: dict) -> dict:
    import transformers

    return throughput_record(name, workload, elapsed, version=transformers.__version__, **extra)


def warm_up(model, workload: list[BenchRequest]) -> None:  # noqa: ANN001
    """One short untimed ``generate``, as our engine gets one before its timed run."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([workload[0].prompt_token_ids], device=model.device)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, eos_token_id=None, pad_token_id=0)


def run_padded(model, workload: list[BenchRequest], batch_size: int = 16) -> dict:  # noqa: ANN001
    """Static batches through ``generate``; returns the result record."""
    import torch

    warm_up(model, workload)
    pad_id = 0
    start = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for first in range(0, len(workload), batch_size):
            batch = workload[first : first + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.tensor([[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch],
                               device=model.device)
            mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                                 for r in batch], device=model.device)
            max_new = max(r.output_len for r in batch)
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                do_sample=False, eos_token_id=None, pad_token_id=pad_id,
            )
            generated += (out.shape[1] - width) * len(batch)
            if out.shape[1] - width != max_new:
                raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, asked for {max_new}")
    elapsed = time.perf_counter() - start
    return _result(
        "transformers-generate-padded", workload, elapsed,
        {"batch_size": batch_size, "generated_tokens_incl_padding": generated},
    )


def run_continuous(model, workload: list[BenchRequest]) -> dict:  # noqa: ANN001
    """Transformers' continuous batching manager, one request per workload entry."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in workload), eos_token_id=None, pad_token_id=0)
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in workload),
        max_generated_length=max(r.output_len for r in workload),
        num_requests=len(workload),
    )
    # its manager logs every request at INFO; keep the benchmark's output readable
    logging.getLogger("transformers").setLevel(logging.WARNING)
    warm_up(model, workload)
    results = {}
    with torch.inference_mode():
        start = time.perf_counter()
        with model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=30, workload_hints=hints, warmup=False
        ) as manager:
            ids = [
                # an EOS id the vocabulary never produces: EOS is ignored, like in our run
                manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1)
                for i, r in enumerate(workload)
            ]
            while len(results) < len(ids):
                res = manager.get_result(timeout=5)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped early")
                    continue
                if res.is_finished():
                    results[res.request_id] = res
        elapsed = time.perf_counter() - start
    for i, r in enumerate(workload):
        got = len(results[f"r{i}"].generated_tokens)
        if got != r.output_len:
            raise RuntimeError(f"transformers continuous batching gave request {i} {got} tokens, asked {r.output_len}")
    return _result("transformers-continuous-batching", workload, elapsed, {})
