"""Loading a GGUF file holds its bytes once (issue 48's "real sizes", at a small shape).

A Llama-shaped F16 file (kept as its bytes by the GGUF kernels) with an untied 49,152-row LM head is
written with the ``gguf`` package; a fresh process imports pagedllm, then builds ``LLM`` on it. The
resident set may grow during the load by the file's tensor bytes plus a bound for what is not the
weights (the tokenizer, the KV pages a warm-up writes, the kernels' libraries, allocator slack): a load
that holds the file's pages, a private copy of a tensor or a float32 table beside the blocks grows by
the vocabulary tables' 75 MB or more on top. ``benchmarks/load_memory.py`` measures the same at 1B-8B
shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

import pagedllm
from pagedllm.loader import bundled_model_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")]

HIDDEN, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, FFN = 768, 6, 12, 4, 2048
HEAD_DIM = HIDDEN // NUM_HEADS
# what the process may hold beyond the file's tensors during the load and through the first tokens: 41 MB
# at the peak, 32 MB after, here (the tokenizer, the metadata, the KV pages written, thread pools, allocator
# slack); before the loader kept the file's pages copy-on-write and took the vocabulary tables first, the
# peak was 193 MB over (a private copy of each tensor beside its mapped pages, at the end of the load)
SLACK_BYTES = 64 << 20

_CHILD = r"""
import json, sys

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import load_kernels
load_kernels()  # the kernels' libraries are the import's share, not the load's
before = status("VmRSS")
llm = LLM(model=sys.argv[1], max_model_len=256, num_kv_blocks=64)
peak_load, after = status("VmHWM"), status("VmRSS")
tokens = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids
print(json.dumps({"before": before, "peak_load": peak_load, "after": after, "peak": status("VmHWM"),
                  "tokens": list(tokens)}))
"""


def _write_f16_llama(path: str) -> int:
    """A random Llama-shaped GGUF (F16 matrices, F32 norms, the bundled tokenizer); returns its tensors' bytes."""
    source = GGUFReader(bundled_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer = GGUFWriter(path, "llama")
    for key, value in (("block_count", NUM_LAYERS), ("context_length", 2048), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", NUM_HEADS),
                       ("attention.head_count_kv", NUM_KV_HEADS)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    rng = np.random.default_rng(0)
    shapes = [("token_embd.weight", (vocab, HIDDEN))]
    for i in range(NUM_LAYERS):
        shapes += [(f"blk.{i}.attn_norm.weight", (HIDDEN,)), (f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN)),
                   (f"blk.{i}.attn_k.weight", (NUM_KV_HEADS * HEAD_DIM, HIDDEN)),
                   (f"blk.{i}.attn_v.weight", (NUM_KV_HEADS * HEAD_DIM, HIDDEN)),
                   (f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN)), (f"blk.{i}.ffn_norm.weight", (HIDDEN,)),
                   (f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN)), (f"blk.{i}.ffn_up.weight", (FFN, HIDDEN)),
                   (f"blk.{i}.ffn_down.weight", (HIDDEN, FFN))]
    shapes += [("output_norm.weight", (HIDDEN,)), ("output.weight", (vocab, HIDDEN))]
    total = 0
    for name, shape in shapes:
        if len(shape) == 1:
            data = np.ones(shape, np.float32)
        else:
            data = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        writer.add_tensor(name, data)
        total += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total


def test_a_gguf_load_grows_the_resident_set_by_its_tensors_once(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "llama-f16.gguf")
    tensor_bytes = _write_f16_llama(path)
    assert tensor_bytes > 200e6  # the two 75 MB vocabulary tables and 6 layers: large next to the slack
    # the child imports this checkout's pagedllm, whatever the installed one is
    root = os.path.dirname(os.path.dirname(pagedllm.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _CHILD, path], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(measured["tokens"]) == 2
    bound = measured["before"] + tensor_bytes + SLACK_BYTES
    # during the load, once loaded, and through the first tokens
    for key in ("peak_load", "after", "peak"):
        assert measured[key] <= bound, (key, measured, bound, tensor_bytes)
