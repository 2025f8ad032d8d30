"""Write a random-weight GGUF at the real shape of Llama 3.2 1B / 3B or Llama 3.1 8B, then quantize it.

Issue 48's "real sizes" are measured on files of the sizes people download, with no such model on this
machine: this script writes one with the ``gguf`` package's writer at the model's real shape (every
tensor name, shape and order of llama.cpp's converter, the ``rope_freqs`` tensor of Llama 3.1's
``llama3`` RoPE scaling, a tied embedding for 1B and 3B), in F16 and random values (normal, std 0.02;
norms 1), then runs ``llama-quantize`` on it (Q4_K_M, IQ4_XS...: llama.cpp's own mix of block types per
tensor), so load memory, load time and step costs are a real model's of that size.

The tokenizer is the bundled SmolLM2's (GPT-2 BPE, 49,152 tokens) with normal ``[PADn]`` tokens added up
to Llama 3's 128,256 (the embedding's and LM head's rows): no merge reaches them, so text tokenizes as
SmolLM2's does in both engines. Outputs are noise; the cost of computing them is not.

    PYTHONPATH=. .venv/bin/python benchmarks/real_size_gguf.py 8b /work/peer-data/llama8b-q4_k_m.gguf \
        [--type Q4_K_M] [--quantize /work/peer-venvs/llamacpp/bin/llama-quantize] [--keep-f16]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from pagedllm.loader import bundled_model_path

VOCAB_SIZE = 128256
POOL_VALUES = 1 << 26  # random values drawn once; each tensor is filled from it at random offsets


@dataclass(frozen=True)
class Shape:
    """A Llama 3.x model's shape (its config.json's numbers) and its llama3 RoPE scaling factor."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied: bool
    rope_factor: float


SHAPES = {
    "1b": Shape(2048, 16, 32, 8, 64, 8192, True, 32.0),     # Llama-3.2-1B
    "3b": Shape(3072, 28, 24, 8, 128, 8192, True, 32.0),    # Llama-3.2-3B
    "8b": Shape(4096, 32, 32, 8, 128, 14336, False, 8.0),   # Llama-3.1-8B
}


def llama3_rope_freqs(shape: Shape, base: float = 500000.0, low: float = 1.0, high: float = 4.0,
                      original_len: int = 8192) -> np.ndarray:
    """Per rotated pair, the divisor of its frequency under transformers' ``llama3`` RoPE scaling.

    Long wavelengths (past original_len / low) are divided by the factor, short ones (under
    original_len / high) kept, and the band between blended linearly in original_len / wavelength.
    """
    inv_freq = base ** -(np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original_len / wavelen - low) / (high - low), 0.0, 1.0)
    # the scaled frequency is (1 - smooth) * f / factor + smooth * f: its divisor is the reciprocal
    return (1.0 / ((1.0 - smooth) / shape.rope_factor + smooth)).astype(np.float32)


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [out, in]) in the converter's order."""
    h, q, kv, ffn = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    names: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (VOCAB_SIZE, h))]
    for i in range(shape.num_layers):
        names += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.ffn_down.weight", (h, ffn)),
                  (f"blk.{i}.ffn_gate.weight", (ffn, h)), (f"blk.{i}.ffn_up.weight", (ffn, h)),
                  (f"blk.{i}.ffn_norm.weight", (h,)), (f"blk.{i}.attn_k.weight", (kv, h)),
                  (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.attn_q.weight", (q, h)),
                  (f"blk.{i}.attn_v.weight", (kv, h))]
    names.append(("output_norm.weight", (h,)))
    if not shape.tied:
        names.append(("output.weight", (VOCAB_SIZE, h)))
    names.append(("rope_freqs.weight", (shape.head_dim // 2,)))
    return names


def add_metadata(writer: GGUFWriter, shape: Shape, label: str) -> None:
    """Llama 3.x's hyperparameters and the bundled file's tokenizer, padded to 128,256 tokens."""
    writer.add_string("general.type", "model")
    writer.add_string("general.name", f"random Llama 3.x {label.upper()} shape (issue 48)")
    writer.add_uint32("llama.block_count", shape.num_layers)
    writer.add_uint32("llama.context_length", 131072)
    writer.add_uint32("llama.embedding_length", shape.hidden_size)
    writer.add_uint32("llama.feed_forward_length", shape.intermediate_size)
    writer.add_uint32("llama.attention.head_count", shape.num_heads)
    writer.add_uint32("llama.attention.head_count_kv", shape.num_kv_heads)
    writer.add_uint32("llama.attention.key_length", shape.head_dim)
    writer.add_uint32("llama.attention.value_length", shape.head_dim)
    writer.add_uint32("llama.rope.dimension_count", shape.head_dim)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("llama.vocab_size", VOCAB_SIZE)
    writer.add_uint32("general.file_type", 1)  # MOSTLY_F16
    add_tokenizer(writer, VOCAB_SIZE)


def add_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    """The bundled file's tokenizer, padded with normal ``[PADn]`` tokens (no merge makes them) to ``vocab_size``."""
    source = GGUFReader(bundled_model_path())
    for field in source.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab_size)]
        elif field.name == "tokenizer.ggml.token_type":
            value = value + [1] * (vocab_size - len(value))  # normal tokens that no merge produces
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)


def random_tensor(name: str, np_shape: tuple[int, ...], shape: Shape, pool: np.ndarray,
                  rng: np.random.Generator) -> np.ndarray:
    """One tensor's values: norms 1, rope_freqs the llama3 divisors, matrices F16 from the random pool."""
    if name == "rope_freqs.weight":
        return llama3_rope_freqs(shape)
    if len(np_shape) == 1:
        return np.ones(np_shape, np.float32)
    out = np.empty(math.prod(np_shape), np.float16)
    chunk = len(pool) // 2
    for start in range(0, out.size, chunk):
        n = min(chunk, out.size - start)
        offset = int(rng.integers(0, len(pool) - n + 1))
        out[start:start + n] = pool[offset:offset + n]
    return out.reshape(np_shape)


def write_f16(label: str, path: Path, seed: int = 0) -> None:
    """The F16 file of model ``label`` ("1b", "3b", "8b"), one tensor in memory at a time."""
    shape = SHAPES[label]
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_VALUES, dtype=np.float32) * 0.02).astype(np.float16)
    writer = GGUFWriter(str(path), "llama")
    add_metadata(writer, shape, label)
    shapes = tensor_shapes(shape)
    for name, np_shape in shapes:
        dtype = np.float32 if len(np_shape) == 1 else np.float16
        writer.add_tensor_info(name, np_shape, np.dtype(dtype), math.prod(np_shape) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, np_shape in shapes:
        writer.write_tensor_data(random_tensor(name, np_shape, shape, pool, rng))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type, or F16 to keep the F16 file")
    parser.add_argument("--quantize", default="/work/peer-venvs/llamacpp/bin/llama-quantize")
    parser.add_argument("--f16", type=Path, help="the F16 file (default OUT.f16.gguf; reused when it exists)")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file after quantizing")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    f16 = args.out if args.type.upper() == "F16" else (args.f16 or args.out.with_suffix(".f16.gguf"))
    if not f16.exists():
        start = time.perf_counter()
        write_f16(args.model, f16)
        print(f"wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")
    if f16 == args.out:
        return
    start = time.perf_counter()
    subprocess.run([args.quantize, str(f16), str(args.out), args.type, str(args.threads)], check=True,
                   stdout=subprocess.DEVNULL)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB, {args.type}) in "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    if not args.keep_f16:
        f16.unlink()


if __name__ == "__main__":
    main()
