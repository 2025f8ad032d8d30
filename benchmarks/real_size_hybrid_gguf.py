"""Write a random-weight Qwen3.5 GGUF (``qwen35`` dense or ``qwen35moe`` experts hybrid) at a real model's shape, then
quantize it.

Issue 52's peer comparison runs on files of the sizes people download; no Qwen3.5 model is on this
machine, so this script writes one the way ``benchmarks/real_size_gguf.py`` writes Llama's: the
``gguf`` package's writer at the model's real shape, F16 matrices of random values (normal, std 0.02)
and F32 vectors, then ``llama-quantize`` (Q4_K_M by default: llama.cpp's own mix of block types).

What llama.cpp's converter (``convert_hf_to_gguf.py``, ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``) writes
for a text-only Qwen3.5 checkpoint, run with ``--no-mtp`` (pagedllm does not read the multi-token-prediction
head): the same tensor names, numpy shapes, types (F32 for norms, ``ssm_a``, ``ssm_dt.bias``, the conv and the
routers ``ffn_gate_inp`` / ``ffn_gate_inp_shexp``, F16 for the other matrices) and order (the checkpoint's
names sorted: ``blk.0, blk.1, blk.10...``; transformers' fused ``gate_up_proj`` gives ``ffn_gate_exps`` then
``ffn_up_exps``, after ``ffn_down_exps``), and the same ``qwen35.*`` / ``qwen35moe.*`` keys (``ssm.*``,
``attention.recurrent_layers``, ``rope.dimension_sections`` [11, 11, 10, 0], ``full_attention_interval``;
``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
``expert_shared_feed_forward_length``, and no ``feed_forward_length`` where the config has no dense width, as
Qwen3.5-MoE's). The keys come in the converter's order for a config without ``mrope_section`` (the real
configs have one, and their files list ``rope.dimension_sections`` after ``attention.head_count_kv``: no
reader cares). tests/models/test_family_qwen3_next.py checks all that against the converter's files of tiny
checkpoints of the same configs. Values follow transformers' initialisation where it matters for the
recurrence: ``ssm_a`` = -A with A uniform in (0.5, 16), ``ssm_dt.bias`` 1, the conv uniform in +-0.5, every
norm 1 (the file holds ``1 + w``, w = 0); the routers are normal (std 0.02) like the matrices.

Shapes (``SHAPES``): ``2b`` is Qwen/Qwen3.5-2B's text config (hidden 2048, 24 layers of [linear x3, full] x6,
MLP 6144, 8 query / 2 KV heads of 256 with the output gate and a quarter of each head rotated, Gated DeltaNet
16 key / 16 value heads of 128, conv 4, vocab 248,320, tied embedding, rope theta 1e7); its Q4_K_M file here
is 1.2x GB, like the published ones (unsloth's Qwen3.5-2B-Q4_K_M.gguf: 1,280,835,840 bytes). ``9b`` is
transformers' ``Qwen3_5TextConfig()`` defaults (documented as the Qwen3.5-9B-style configuration: hidden 4096,
32 layers, MLP 12288, 16 / 4 heads of 256, 16 key / 32 value heads of 128, untied). ``35b-a3b`` is
transformers' ``Qwen3_5MoeTextConfig()`` defaults (its docstring: the Qwen/Qwen3.5-35B-A3B configuration;
Qwen3.6-35B-A3B has the same architecture and numbers, as its model card lists): hidden 2048, 40 layers of
[linear x3, full] x10, 256 experts of 512, 8 routed per token, one shared expert of 512 with a sigmoid gate
and no dense MLP, 16 query / 2 KV heads of 256 with the output gate, 16 key / 32 value heads of 128, vocab
248,320, untied, rope theta 1e7 (the published files' ``qwen35moe.*`` keys, as llama.cpp's load logs in its
issues show them, hold the same numbers). Its F16 file is 69.4 GB, more than this disk holds: ``--layers N``
writes a model of only its first N layers (about 1.68 GB F16 each, plus 2.03 GB of embedding and output);
llama-quantize's Q4_K_M of 12 layers is 6,521 MiB (6.84 GB; of all 40: 20,176 MiB), by its ``--dry-run``.
llama-quantize picks some tensors' types by the layer's place among the file's layers (``ffn_down_exps`` Q6_K
in half of them, the first and last among them), so a cut file's layers are quantized as a 12-layer model's;
per layer the sizes agree (487.6 MiB either way).

The tokenizer is the bundled SmolLM2's, padded with ``[PADn]`` tokens to the vocabulary
(``real_size_gguf.add_tokenizer``). Outputs are noise; the cost of computing them is not.

    PYTHONPATH=. .venv/bin/python benchmarks/real_size_hybrid_gguf.py 2b /work/peer-data/qwen35-2b-q4_k_m.gguf \
        [--type Q4_K_M] [--quantize PATH] [--keep-f16] [--threads 2]
    PYTHONPATH=. .venv/bin/python benchmarks/real_size_hybrid_gguf.py 35b-a3b \
        /work/peer-data/qwen36-35b-a3b-12l-q4_k_m.gguf --layers 12 [--type Q4_K_M] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from benchmarks.real_size_gguf import add_tokenizer

POOL_VALUES = 1 << 26  # random values drawn once; each matrix is filled from it at random offsets
MROPE_SECTIONS = [11, 11, 10, 0]  # the converter writes Qwen3.5's default when a config has none


@dataclass(frozen=True)
class ExpertShape:
    """A Qwen3.5-MoE model's experts (its text config's numbers): every layer's MLP is the experts."""

    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int


@dataclass(frozen=True)
class HybridShape:
    """A Qwen3.5 model's shape (its text config's numbers); with ``experts``, a ``qwen35moe`` one, whose
    ``intermediate_size`` is the config's (None: it has none, and the file no ``feed_forward_length``)."""

    hidden_size: int
    num_layers: int
    intermediate_size: int | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    vocab_size: int
    tied: bool
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1e7
    context_len: int = 262144
    experts: ExpertShape | None = None

    def __post_init__(self) -> None:
        if self.experts is None and self.intermediate_size is None:
            raise ValueError("a dense Qwen3.5 shape needs its intermediate_size")

    @property
    def arch(self) -> str:
        """The GGUF architecture the converter writes for it."""
        return "qwen35" if self.experts is None else "qwen35moe"

    def is_linear(self, layer: int) -> bool:
        """Whether ``layer`` is Gated DeltaNet (every ``full_attention_interval``-th is full attention)."""
        return (layer + 1) % self.full_attention_interval != 0


SHAPES = {
    "2b": HybridShape(2048, 24, 6144, 8, 2, 256, 16, 16, 128, 128, 4, 248320, True),
    "9b": HybridShape(4096, 32, 12288, 16, 4, 256, 16, 32, 128, 128, 4, 248320, False),
    "35b-a3b": HybridShape(2048, 40, None, 16, 2, 256, 16, 32, 128, 128, 4, 248320, False,
                           experts=ExpertShape(256, 8, 512, 512)),
}
_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # the experts' and the shared expert's gate
# the matrices the converter keeps in F32 (besides every vector)
_F32_MATRICES = ("ssm_conv1d.weight", *_ROUTERS)


def first_layers(shape: HybridShape, layers: int) -> HybridShape:
    """``shape`` cut to its first ``layers`` layers (the file of a model that has only those)."""
    if not 1 <= layers <= shape.num_layers:
        raise ValueError(f"--layers must be in 1..{shape.num_layers}, got {layers}")
    return replace(shape, num_layers=layers)


def _mlp_tensors(s: HybridShape, i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(checkpoint name, GGUF name, numpy shape) of layer ``i``'s MLP: dense, or the experts as the converter
    writes transformers' fused ``gate_up_proj`` (gate rows, then up: the ``.0`` / ``.1`` keep that order)."""
    h, p, b = s.hidden_size, f"model.layers.{i}.mlp.", f"blk.{i}."
    if s.experts is None:
        return [(p + "gate_proj.weight", b + "ffn_gate.weight", (s.intermediate_size, h)),
                (p + "up_proj.weight", b + "ffn_up.weight", (s.intermediate_size, h)),
                (p + "down_proj.weight", b + "ffn_down.weight", (h, s.intermediate_size))]
    e, ff, shared = s.experts.num_experts, s.experts.moe_intermediate_size, s.experts.shared_expert_intermediate_size
    return [(p + "experts.down_proj", b + "ffn_down_exps.weight", (e, h, ff)),
            (p + "experts.gate_up_proj.0", b + "ffn_gate_exps.weight", (e, ff, h)),
            (p + "experts.gate_up_proj.1", b + "ffn_up_exps.weight", (e, ff, h)),
            (p + "gate.weight", b + "ffn_gate_inp.weight", (e, h)),
            (p + "shared_expert.down_proj.weight", b + "ffn_down_shexp.weight", (h, shared)),
            (p + "shared_expert.gate_proj.weight", b + "ffn_gate_shexp.weight", (shared, h)),
            (p + "shared_expert.up_proj.weight", b + "ffn_up_shexp.weight", (shared, h)),
            (p + "shared_expert_gate.weight", b + "ffn_gate_inp_shexp.weight", (1, h))]


def _layer_tensors(s: HybridShape, i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(checkpoint name, GGUF name, numpy shape) of layer ``i``'s tensors."""
    h, p, b = s.hidden_size, f"model.layers.{i}.", f"blk.{i}."
    out = [(p + "input_layernorm.weight", b + "attn_norm.weight", (h,)),
           (p + "post_attention_layernorm.weight", b + "post_attention_norm.weight", (h,)),
           *_mlp_tensors(s, i)]
    if s.is_linear(i):
        key_dim = s.linear_num_key_heads * s.linear_key_head_dim
        value_dim = s.linear_num_value_heads * s.linear_value_head_dim
        nv, a = s.linear_num_value_heads, p + "linear_attn."
        out += [(a + "A_log", b + "ssm_a", (nv,)), (a + "dt_bias", b + "ssm_dt.bias", (nv,)),
                (a + "conv1d.weight", b + "ssm_conv1d.weight", (2 * key_dim + value_dim, s.conv_kernel)),
                (a + "in_proj_a.weight", b + "ssm_alpha.weight", (nv, h)),
                (a + "in_proj_b.weight", b + "ssm_beta.weight", (nv, h)),
                (a + "in_proj_qkv.weight", b + "attn_qkv.weight", (2 * key_dim + value_dim, h)),
                (a + "in_proj_z.weight", b + "attn_gate.weight", (value_dim, h)),
                (a + "norm.weight", b + "ssm_norm.weight", (s.linear_value_head_dim,)),
                (a + "out_proj.weight", b + "ssm_out.weight", (h, value_dim))]
    else:
        q, kv, a = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, p + "self_attn."
        out += [(a + "q_proj.weight", b + "attn_q.weight", (2 * q, h)),  # query and output gate rows
                (a + "k_proj.weight", b + "attn_k.weight", (kv, h)), (a + "v_proj.weight", b + "attn_v.weight", (kv, h)),
                (a + "o_proj.weight", b + "attn_output.weight", (h, q)),
                (a + "q_norm.weight", b + "attn_q_norm.weight", (s.head_dim,)),
                (a + "k_norm.weight", b + "attn_k_norm.weight", (s.head_dim,))]
    return out


def tensor_shapes(s: HybridShape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, numpy shape, stored as F32) in the converter's order: the checkpoint's names sorted."""
    named = [("model.embed_tokens.weight", "token_embd.weight", (s.vocab_size, s.hidden_size)),
             ("model.norm.weight", "output_norm.weight", (s.hidden_size,))]
    if not s.tied:
        named.append(("lm_head.weight", "output.weight", (s.vocab_size, s.hidden_size)))
    for i in range(s.num_layers):
        named += _layer_tensors(s, i)
    # the converter keeps vectors, the conv and the routers in F32, every other matrix in the output type
    return [(gguf, shape, len(shape) == 1 or gguf.endswith(_F32_MATRICES))
            for _, gguf, shape in sorted(named)]


def add_metadata(writer: GGUFWriter, s: HybridShape, name: str) -> None:
    """The converter's ``qwen35`` / ``qwen35moe`` keys, in its order, and the padded tokenizer."""
    a = s.arch
    writer.add_string("general.type", "model")
    writer.add_string("general.name", name)
    sizes = [("block_count", s.num_layers), ("context_length", s.context_len), ("embedding_length", s.hidden_size)]
    if s.intermediate_size is not None:  # the converter writes it only when the config has one
        sizes.append(("feed_forward_length", s.intermediate_size))
    for key, value in (*sizes, ("attention.head_count", s.num_heads), ("attention.head_count_kv", s.num_kv_heads)):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    if s.experts is not None:
        writer.add_uint32(f"{a}.expert_count", s.experts.num_experts)
        writer.add_uint32(f"{a}.expert_used_count", s.experts.experts_per_token)
    writer.add_uint32(f"{a}.attention.key_length", s.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", s.head_dim)
    writer.add_uint32("general.file_type", 1)  # MOSTLY_F16
    if s.experts is not None:
        writer.add_uint32(f"{a}.expert_feed_forward_length", s.experts.moe_intermediate_size)
        writer.add_uint32(f"{a}.expert_shared_feed_forward_length", s.experts.shared_expert_intermediate_size)
    for key, value in (("ssm.conv_kernel", s.conv_kernel), ("ssm.state_size", s.linear_key_head_dim),
                       ("ssm.group_count", s.linear_num_key_heads), ("ssm.time_step_rank", s.linear_num_value_heads),
                       ("ssm.inner_size", s.linear_value_head_dim * s.linear_num_value_heads)):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_array(f"{a}.attention.recurrent_layers", [s.is_linear(i) for i in range(s.num_layers)])
    writer.add_uint32(f"{a}.full_attention_interval", s.full_attention_interval)
    writer.add_uint32(f"{a}.rope.dimension_count", int(s.head_dim * s.partial_rotary_factor))
    writer.add_key_value(f"{a}.rope.dimension_sections", MROPE_SECTIONS, GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.INT32)
    writer.add_uint32("general.quantization_version", 2)
    add_tokenizer(writer, s.vocab_size)


def from_pool(np_shape: tuple[int, ...], pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """F16 values of ``np_shape`` copied from ``pool`` at random offsets (drawing each anew is minutes)."""
    out = np.empty(math.prod(np_shape), np.float16)
    chunk = len(pool) // 2
    for start in range(0, out.size, chunk):
        n = min(chunk, out.size - start)
        offset = int(rng.integers(0, len(pool) - n + 1))
        out[start:start + n] = pool[offset:offset + n]
    return out.reshape(np_shape)


def random_tensor(name: str, np_shape: tuple[int, ...], pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One tensor's values (see the module docstring)."""
    if name.endswith(_ROUTERS):  # the pool's values, in F32 as the file holds them
        return from_pool(np_shape, pool, rng).astype(np.float32)
    if name.endswith(".ssm_a"):
        return -rng.uniform(0.5, 16.0, np_shape).astype(np.float32)
    if name.endswith("ssm_conv1d.weight"):
        return rng.uniform(-0.5, 0.5, np_shape).astype(np.float32)
    if len(np_shape) == 1:  # norms (1 + w with w = 0, the gated norm's w = 1) and dt_bias
        return np.ones(np_shape, np.float32)
    return from_pool(np_shape, pool, rng)


def write_f16(shape: HybridShape, path: Path, name: str, seed: int = 0) -> None:
    """The F16 file of ``shape``, one tensor in memory at a time."""
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_VALUES, dtype=np.float32) * 0.02).astype(np.float16)
    writer = GGUFWriter(str(path), shape.arch)
    add_metadata(writer, shape, name)
    tensors = tensor_shapes(shape)
    for tensor_name, np_shape, f32 in tensors:
        dtype = np.dtype(np.float32 if f32 else np.float16)
        writer.add_tensor_info(tensor_name, np_shape, dtype, math.prod(np_shape) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor_name, np_shape, _ in tensors:
        writer.write_tensor_data(random_tensor(tensor_name, np_shape, pool, rng))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type, or F16 to keep the F16 file")
    parser.add_argument("--quantize", default="/work/peer-venvs/llamacpp/bin/llama-quantize")
    parser.add_argument("--f16", type=Path, help="the F16 file (default OUT.f16.gguf; reused when it exists, "
                        "whatever its layers)")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file after quantizing")
    parser.add_argument("--layers", type=int, help="write only the first N layers (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    shape, name = SHAPES[args.model], f"random Qwen3.5 {args.model.upper()} shape (issue 52)"
    if args.layers is not None:
        try:
            shape = first_layers(shape, args.layers)
        except ValueError as e:
            parser.error(str(e))
        name += f", its first {args.layers} of {SHAPES[args.model].num_layers} layers"
    f16 = args.out if args.type.upper() == "F16" else (args.f16 or args.out.with_suffix(".f16.gguf"))
    if not f16.exists():
        start = time.perf_counter()
        write_f16(shape, f16, name)
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
