"""Write a random-weight mixture-of-experts GGUF at a real model's shape, in its blocks, without a float copy.

Issue 49's benchmarks run on files of the sizes people download: Qwen3-30B-A3B in Q4_K_M (~17-18 GB) and
gpt-oss-20b with MXFP4 experts (~12 GB). A float file of 30B weights (61 GB) does not fit this machine's
disk, so ``llama-quantize`` cannot make them as ``benchmarks/real_size_gguf.py`` makes the dense ones:
this script writes each tensor's blocks directly, as random bytes with the scale fields set to finite
values of a sane size, in the type llama.cpp's mix gives that tensor:

* ``qwen3-30b-a3b`` (Q4_K_M): Q4_K everywhere, Q6_K for ``attn_v`` and ``ffn_down_exps`` in the layers
  llama.cpp's ``use_more_bits`` picks (the first and last eighth, and every third between) and for the
  output head; norms and the router F32, as the converter and ``llama-quantize`` leave them.
* ``gpt-oss-20b`` (MXFP4 experts): experts MXFP4 (as OpenAI ships them and the converter keeps them),
  every other matrix Q8_0, biases, sinks, norms and the router F32.

Names, shapes, order and metadata keys are those llama.cpp's converter writes for the architecture
(``qwen3moe``, ``gpt-oss``). The tokenizer is the bundled SmolLM2's, padded with ``[PADn]`` tokens to
the model's vocabulary (``real_size_gguf.py``'s way). ``--layers N`` writes the first N layers only (the
layer count is then in ``general.name``; say it with any figure).

    PYTHONPATH=. .venv/bin/python benchmarks/real_size_moe_gguf.py qwen3-30b-a3b \
        /work/peer-data/qwen3-30b-a3b-q4_k_m.gguf [--layers 48]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from benchmarks.real_size_gguf import add_tokenizer

POOL_BYTES = 1 << 26  # random bytes drawn once; each tensor is filled from it at random offsets


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's shape (its config.json's numbers)."""

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    vocab_size: int
    context_len: int
    rope_theta: float


SHAPES = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": MoEShape("qwen3moe", 2048, 48, 32, 4, 128, 128, 8, 768, 151936, 40960, 1e6),
    # openai/gpt-oss-20b config.json
    "gpt-oss-20b": MoEShape("gpt-oss", 2880, 24, 64, 8, 64, 32, 4, 2880, 201088, 131072, 150000.0),
}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose ``attn_v`` / ``ffn_down`` take Q6_K."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def qwen3moe_tensors(s: MoEShape, num_layers: int) -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, numpy shape, type) in the converter's order: Q4_K_M's mix."""
    h, q, kv, e, ff = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_experts, \
        s.expert_intermediate_size
    out: list[tuple[str, tuple[int, ...], Q]] = [("token_embd.weight", (s.vocab_size, h), Q.Q4_K)]
    for i in range(num_layers):
        more = Q.Q6_K if use_more_bits(i, s.num_layers) else Q.Q4_K
        out += [(f"blk.{i}.attn_norm.weight", (h,), Q.F32),
                (f"blk.{i}.attn_q.weight", (q, h), Q.Q4_K), (f"blk.{i}.attn_k.weight", (kv, h), Q.Q4_K),
                (f"blk.{i}.attn_v.weight", (kv, h), more), (f"blk.{i}.attn_output.weight", (h, q), Q.Q4_K),
                (f"blk.{i}.attn_q_norm.weight", (s.head_dim,), Q.F32),
                (f"blk.{i}.attn_k_norm.weight", (s.head_dim,), Q.F32),
                (f"blk.{i}.ffn_norm.weight", (h,), Q.F32), (f"blk.{i}.ffn_gate_inp.weight", (e, h), Q.F32),
                (f"blk.{i}.ffn_gate_exps.weight", (e, ff, h), Q.Q4_K),
                (f"blk.{i}.ffn_up_exps.weight", (e, ff, h), Q.Q4_K),
                (f"blk.{i}.ffn_down_exps.weight", (e, h, ff), more)]
    out += [("output_norm.weight", (h,), Q.F32), ("output.weight", (s.vocab_size, h), Q.Q6_K)]
    return out


def gpt_oss_tensors(s: MoEShape, num_layers: int) -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, numpy shape, type) in the converter's order: MXFP4 experts, Q8_0 other matrices."""
    h, q, kv, e, ff = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_experts, \
        s.expert_intermediate_size
    out: list[tuple[str, tuple[int, ...], Q]] = [("token_embd.weight", (s.vocab_size, h), Q.Q8_0)]
    for i in range(num_layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,), Q.F32),
                (f"blk.{i}.attn_q.weight", (q, h), Q.Q8_0), (f"blk.{i}.attn_q.bias", (q,), Q.F32),
                (f"blk.{i}.attn_k.weight", (kv, h), Q.Q8_0), (f"blk.{i}.attn_k.bias", (kv,), Q.F32),
                (f"blk.{i}.attn_v.weight", (kv, h), Q.Q8_0), (f"blk.{i}.attn_v.bias", (kv,), Q.F32),
                (f"blk.{i}.attn_output.weight", (h, q), Q.Q8_0), (f"blk.{i}.attn_output.bias", (h,), Q.F32),
                (f"blk.{i}.attn_sinks.weight", (s.num_heads,), Q.F32),
                (f"blk.{i}.post_attention_norm.weight", (h,), Q.F32),
                (f"blk.{i}.ffn_gate_inp.weight", (e, h), Q.F32), (f"blk.{i}.ffn_gate_inp.bias", (e,), Q.F32),
                (f"blk.{i}.ffn_gate_exps.weight", (e, ff, h), Q.MXFP4),
                (f"blk.{i}.ffn_gate_exps.bias", (e, ff), Q.F32),
                (f"blk.{i}.ffn_up_exps.weight", (e, ff, h), Q.MXFP4),
                (f"blk.{i}.ffn_up_exps.bias", (e, ff), Q.F32),
                (f"blk.{i}.ffn_down_exps.weight", (e, h, ff), Q.MXFP4),
                (f"blk.{i}.ffn_down_exps.bias", (e, h), Q.F32)]
    out += [("output_norm.weight", (h,), Q.F32), ("output.weight", (s.vocab_size, h), Q.Q8_0)]
    return out


def add_metadata(writer: GGUFWriter, s: MoEShape, label: str, num_layers: int) -> None:
    """The architecture's hyperparameters under the converter's keys, and the padded tokenizer."""
    a = s.arch
    writer.add_string("general.type", "model")
    writer.add_string("general.name", f"random {label} shape, {num_layers} of {s.num_layers} layers (issue 49)")
    for key, value in (("block_count", num_layers), ("context_length", s.context_len),
                       ("embedding_length", s.hidden_size), ("feed_forward_length", s.expert_intermediate_size),
                       ("attention.head_count", s.num_heads), ("attention.head_count_kv", s.num_kv_heads),
                       ("attention.key_length", s.head_dim), ("attention.value_length", s.head_dim),
                       ("expert_count", s.num_experts), ("expert_used_count", s.top_k),
                       ("expert_feed_forward_length", s.expert_intermediate_size), ("vocab_size", s.vocab_size)):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if a == "qwen3moe" else 1e-5)
    if a == "gpt-oss":
        writer.add_uint32(f"{a}.attention.sliding_window", 128)
        writer.add_string(f"{a}.rope.scaling.type", "yarn")
        writer.add_float32(f"{a}.rope.scaling.factor", 32.0)
        writer.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
    writer.add_uint32("general.file_type", 15 if a == "qwen3moe" else 38)  # MOSTLY_Q4_K_M / MOSTLY_MXFP4_MOE
    add_tokenizer(writer, s.vocab_size)


def block_bytes(np_shape: tuple[int, ...], kind: Q) -> tuple[int, int]:
    """(number of blocks, bytes per block) of a tensor of ``np_shape`` in ``kind``."""
    weights, size = GGML_QUANT_SIZES[kind]
    return math.prod(np_shape) // weights, size


def set_scales(blocks: np.ndarray, kind: Q, rng: np.random.Generator) -> None:
    """Overwrite each block's scale fields (random bytes otherwise) with finite values that give weights of
    a few hundredths: Q4_K's ``d``/``dmin`` (first 4 bytes), Q6_K's ``d`` (last 2), Q8_0's ``d`` (first 2),
    MXFP4's E8M0 exponent (first byte: 2^-7)."""
    n = blocks.shape[0]
    if kind == Q.MXFP4:
        blocks[:, 0] = 120
        return
    d = (rng.uniform(0.5, 1.5, n) * {Q.Q4_K: 1.2e-4, Q.Q6_K: 6e-5, Q.Q8_0: 3e-4}[kind]).astype(np.float16)
    col = {Q.Q4_K: 0, Q.Q6_K: blocks.shape[1] - 2, Q.Q8_0: 0}[kind]
    blocks[:, col:col + 2] = d.view(np.uint8).reshape(n, 2)
    if kind == Q.Q4_K:
        blocks[:, 2:4] = (d.astype(np.float32) * 4).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_data(name: str, np_shape: tuple[int, ...], kind: Q, pool: np.ndarray,
                rng: np.random.Generator) -> np.ndarray:
    """One tensor's bytes (quantized: ``[..., row bytes]`` uint8) or float32 values (norms 1, sinks 0,
    biases and the router small and random)."""
    if kind == Q.F32:
        if name.endswith("norm.weight"):
            return np.ones(np_shape, np.float32)
        if name.endswith("attn_sinks.weight"):
            return np.zeros(np_shape, np.float32)
        return (rng.standard_normal(np_shape, dtype=np.float32) * 0.02).astype(np.float32)
    num_blocks, size = block_bytes(np_shape, kind)
    flat = np.empty(num_blocks * size, np.uint8)
    chunk = len(pool) // 2
    for start in range(0, flat.size, chunk):
        n = min(chunk, flat.size - start)
        offset = int(rng.integers(0, len(pool) - n + 1))
        flat[start:start + n] = pool[offset:offset + n]
    set_scales(flat.reshape(num_blocks, size), kind, rng)
    weights = GGML_QUANT_SIZES[kind][0]
    return flat.reshape(*np_shape[:-1], np_shape[-1] // weights * size)


TENSORS: dict[str, Callable[[MoEShape, int], list[tuple[str, tuple[int, ...], Q]]]] = {
    "qwen3moe": qwen3moe_tensors, "gpt-oss": gpt_oss_tensors,
}


def write(label: str, path: Path, num_layers: int | None, seed: int = 0) -> None:
    """The file of model ``label``, one tensor in memory at a time."""
    shape = SHAPES[label]
    num_layers = num_layers or shape.num_layers
    if not 0 < num_layers <= shape.num_layers:
        raise ValueError(f"--layers must be in 1..{shape.num_layers}, got {num_layers}")
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, POOL_BYTES, dtype=np.uint8)
    writer = GGUFWriter(str(path), shape.arch)
    add_metadata(writer, shape, label, num_layers)
    tensors = TENSORS[shape.arch](shape, num_layers)
    for name, np_shape, kind in tensors:
        if kind == Q.F32:
            writer.add_tensor_info(name, np_shape, np.dtype(np.float32), math.prod(np_shape) * 4)
        else:
            num_blocks, size = block_bytes(np_shape, kind)
            byte_shape = (*np_shape[:-1], np_shape[-1] // GGML_QUANT_SIZES[kind][0] * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), num_blocks * size, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, np_shape, kind in tensors:
        writer.write_tensor_data(random_data(name, np_shape, kind, pool, rng))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, help="write only the first N layers (default: all)")
    args = parser.parse_args()
    start = time.perf_counter()
    write(args.model, args.out, args.layers)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
