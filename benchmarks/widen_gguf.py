"""Write a wider copy of a Llama GGUF: the same function, the weight bytes of a model several times its size.

Speculative decoding pays most where the weights dominate a step (a verify of k tokens reads them
once, as a 1-token step does). With no 1B model on this machine, this script makes one whose
predictions are real: every layer of the bundled SmolLM2-135M is padded with zero channels and zero
attention heads up to a 1B shape (hidden 576 -> 1536, heads 9/3 -> 24/8, MLP 1536 -> 6144, the
same 30 layers and vocabulary: 1.1 B parameters). The padded model computes what the original does:

    residual stream   [x | 0 ... 0]         the extra channels start at zero (embedding) and every
                                            output projection writes zero there
    RMSNorm           w' = [w * sqrt(576/1536) | 0]   the mean of squares over 1536 channels is
                                            576/1536 of the original's; eps acts 2.7x larger (1e-5)
    attention         heads 9..23 and KV heads 3..7 are zero: q head h still reads KV head h // 3
    MLP               gate/up rows and down columns past 1536 are zero: silu(0) * 0 = 0

Each tensor keeps its block type (Q4_1 / Q8_0 / F32): a block of the original re-quantizes to
the same bytes, and a block of zeros costs the kernels what any block does. So acceptance rates
are the bundled model's, and a step's cost is a 1B model's.

    PYTHONPATH=. .venv/bin/python benchmarks/widen_gguf.py OUT.gguf [--model SOURCE.gguf]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from pagedllm.loader import bundled_model_path

# the 1B shape: hidden, query heads, KV heads, MLP width (head size and layer count stay the source's)
HIDDEN, NUM_HEADS, NUM_KV_HEADS, FFN = 1536, 24, 8, 6144
HEAD_DIM = 64
SHAPE_KEYS = {"embedding_length": HIDDEN, "feed_forward_length": FFN,
              "attention.head_count": NUM_HEADS, "attention.head_count_kv": NUM_KV_HEADS}


def widened(name: str, w: np.ndarray, src_hidden: int) -> np.ndarray:
    """One tensor (numpy layout: [out, in]) padded with zeros to the 1B shape."""
    def pad(a: np.ndarray, rows: int | None, cols: int | None) -> np.ndarray:
        out = np.zeros((rows or a.shape[0], cols or a.shape[1]) if a.ndim == 2 else (cols,), np.float32)
        out[tuple(slice(0, n) for n in a.shape)] = a
        return out

    if w.ndim == 1:  # RMSNorm weights: rescaled so the mean over the wider hidden is undone
        return pad(w * math.sqrt(src_hidden / HIDDEN), None, HIDDEN)
    if name.endswith("attn_q.weight"):
        return pad(w, NUM_HEADS * HEAD_DIM, HIDDEN)
    if name.endswith(("attn_k.weight", "attn_v.weight")):
        return pad(w, NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    if name.endswith("attn_output.weight"):
        return pad(w, HIDDEN, NUM_HEADS * HEAD_DIM)
    if name.endswith(("ffn_gate.weight", "ffn_up.weight")):
        return pad(w, FFN, HIDDEN)
    if name.endswith("ffn_down.weight"):
        return pad(w, HIDDEN, FFN)
    if name in ("token_embd.weight", "output.weight"):
        return pad(w, None, HIDDEN)
    raise ValueError(f"no rule to widen tensor {name!r} of shape {w.shape}")


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, arch: str) -> None:
    """Every key of the source but the writer's own, with the 1B shape's sizes."""
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        key = field.name.removeprefix(f"{arch}.")
        if key in SHAPE_KEYS:
            writer.add_uint32(field.name, SHAPE_KEYS[key])
            continue
        value = field.contents()
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)


def widen(source: Path, out: Path) -> int:
    """Write the widened copy of the Llama GGUF ``source`` to ``out``; its number of parameters."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"only Llama files are widened, not {arch!r}")
    src_hidden = int(reader.fields["llama.embedding_length"].contents())
    if int(reader.fields["llama.rope.dimension_count"].contents()) != HEAD_DIM or src_hidden > HIDDEN:
        raise ValueError("the source must have 64-wide heads and a hidden size under 1536")
    writer = GGUFWriter(out, arch)
    copy_metadata(reader, writer, arch)
    num_params = 0
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        w = quants.dequantize(t.data, qtype).reshape([int(n) for n in reversed(t.shape)])
        wide = widened(t.name, w, src_hidden)
        num_params += wide.size
        data = wide if qtype == GGMLQuantizationType.F32 else quants.quantize(wide, qtype)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return num_params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", type=Path, default=None, help="source Llama GGUF (default: the bundled model)")
    args = p.parse_args()
    num_params = widen(args.model or Path(bundled_model_path()), args.out)
    print(f"{args.out}: {num_params / 1e9:.2f} B parameters, {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
