"""One 4,090-token prompt alone, prefilled in chunks of N tokens (max_num_batched_tokens=N): seconds and ms per token.
OLD=1 runs prompts that continue cached context through the gathered SDPA path instead of the in-place kernel.
BENCHMARKS.md, "Long prompts among streams, second round".

    .venv/bin/python benchmarks/prefill_chunks.py 16,64,256,2048
"""
import os
import random
import sys
import time

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers import attention as A
from pagedllm.loader import bundled_model_path
from pagedllm.sampling_params import SamplingParams

if os.environ.get("OLD"):
    def _cp(self, i, q, k_cache, v_cache, meta, scale, out):  # noqa: ANN001, ANN202 (the gathered SDPA path)
        self._prefill_one(i, q, None, None, k_cache, v_cache, meta, scale, out)
    A.CpuPagedAttention._continued_prefill = _cp
N = 4090
for c in [int(x) for x in sys.argv[1].split(",")]:
    eng = LLMEngine(EngineConfig(model=bundled_model_path(), num_kv_blocks=512, max_model_len=4096, max_num_batched_tokens=c, itl_target_ms=None))
    rng = random.Random(0)
    eng.add_request("w", {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(64)]}, SamplingParams(temperature=0, max_tokens=2))
    while eng.requests:
        eng.step()
    eng.add_request("long", {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(N)]}, SamplingParams(temperature=0, max_tokens=1))
    t0, n = time.perf_counter(), 0
    while "long" in eng.requests:
        eng.step()
        n += 1
    T = time.perf_counter() - t0
    print(f"{'sdpa-gather' if os.environ.get('OLD') else 'in-place'} chunk {c}: {T:.2f}s steps {n} per-token {T/N*1000:.2f} ms", flush=True)
