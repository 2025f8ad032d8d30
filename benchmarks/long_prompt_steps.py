"""One 4,090-token prompt among STREAMS decoding streams, by engine steps: its time to first token and the
streams' gaps (median, p99, max) with itl_target_ms TARGET (auto, off or ms). BENCHMARKS.md, "Long prompts among streams".

    .venv/bin/python benchmarks/long_prompt_steps.py auto 4
"""
import json
import random
import statistics
import sys
import time

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader import bundled_model_path
from pagedllm.sampling_params import SamplingParams

target, streams = sys.argv[1], int(sys.argv[2])
eng = LLMEngine(EngineConfig(model=bundled_model_path(), num_kv_blocks=512, max_model_len=4096, max_num_batched_tokens=2048,
                             itl_target_ms=None if target == "off" else target))
rng = random.Random(0)
for i in range(streams):
    eng.add_request(f"d{i}", {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(20)]}, SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))


def timed_step() -> float:
    """Seconds of one engine step."""
    t0 = time.perf_counter()
    eng.step()
    return time.perf_counter() - t0


base = [timed_step() for _ in range(30)]
eng.add_request("long", {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(4090)]}, SamplingParams(temperature=0, max_tokens=1))
t0 = time.perf_counter()
steps = []
while "long" in eng.requests:
    steps.append(timed_step())
T = time.perf_counter() - t0
steps += [timed_step() for _ in range(30)]
gaps = sorted(base[10:] + steps)
p99 = gaps[int(0.99 * (len(gaps) - 1))]
print(json.dumps({"target": target, "streams": streams, "decode_step_ms": round(statistics.median(base[10:]) * 1000, 1),
  "ttft_s": round(T, 2), "steps_during_prefill": len(steps) - 30, "gap_median_ms": round(statistics.median(gaps) * 1000, 1),
  "gap_p99_ms": round(p99 * 1000, 1), "gap_max_ms": round(max(gaps) * 1000, 1)}))
