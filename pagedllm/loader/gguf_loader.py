"""Weights and configuration from a GGUF file: quantized tensors as stored, or dequantized at load.

GGUF stores tensors under llama.cpp names and, for the ``llama`` architecture,
with the rows of Q and K permuted for llama.cpp's interleaved RoPE. We rename
to Hugging Face names and undo that permutation, so the model code is the
same for both formats.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import re
import struct
import sys
from collections.abc import Callable, Iterator
from struct import error as struct_error
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from pagedllm.loader.config_fields import check_unread_gguf_metadata
from pagedllm.loader.end_tokens import gguf_end_token_ids
from pagedllm.loader.gguf_gemma import GEMMA_ARCHITECTURES, GEMMA_LAYER_NAMES, gemma_gguf_settings
from pagedllm.loader.gguf_gemma4 import GEMMA4_LAYER_NAMES, gemma4_base_shape, gemma4_gguf_settings
from pagedllm.loader.gguf_qwen35 import (
    QWEN35_ARCHITECTURES,
    QWEN35_LAYER_NAMES,
    columns_moved_in_values,
    gated_query_types,
    gguf_hf_values,
    qwen35_gguf_settings,
)
from pagedllm.loader.gguf_split import split_part_paths
from pagedllm.loader.gpt_oss_config import gguf_gpt_oss_fields
from pagedllm.loader.granite_hybrid_config import gguf_granite_hybrid_fields
from pagedllm.loader.lfm2_config import lfm2_gguf_fields
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.loader.moe_config import gguf_moe_fields
from pagedllm.loader.moe_families_config import gguf_moe_family_fields
from pagedllm.loader.smollm3_granite_config import gguf_family_fields

# Which general.architecture values a model runs is models/registry.py's to say. The metadata below is
# read under any architecture's prefix (Gemma's own in gguf_gemma.py); a tensor with no Hugging Face name
# is refused when it is read.

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Llama's mlp_bias
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    # OLMo 2's norms of the attention and MLP outputs (no attn_norm / ffn_norm there)
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    # gpt-oss: each query head's attention-sink logit (the converter adds ".weight" to the name)
    "attn_sinks.weight": "self_attn.sinks",
    # a mixture of experts: the router, and each projection's experts stacked in one 3-D tensor
    # [experts, rows, cols], handed over one expert at a time as mlp.experts.{e}.<part>.weight
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    # Qwen2-MoE's shared expert and its sigmoid gate ([1, hidden])
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# where an architecture names a tensor otherwise: Phi-3 stores q/k/v and gate/up fused, as its checkpoints do
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    **dict.fromkeys(GEMMA_ARCHITECTURES, GEMMA_LAYER_NAMES),
    "gemma4": GEMMA4_LAYER_NAMES,
    # Qwen3-Next / Qwen3.5: the Gated DeltaNet layers' ssm_* tensors (loader/gguf_qwen35.py)
    **dict.fromkeys(QWEN35_ARCHITECTURES, QWEN35_LAYER_NAMES),
    # LFM2's short conv (the shared names of models/lfm2.py): its [hidden, width] filters and projections
    "lfm2": {"shortconv.conv.weight": "conv.conv_weight", "shortconv.in_proj.weight": "conv.in_proj.weight",
             "shortconv.out_proj.weight": "conv.out_proj.weight"},
    # Granite 4.0-H's Mamba-2 layers: A as the converter stores it, -exp(A_log) (models/granitemoehybrid.py
    # takes it back to A_log and the other tensors to the module's shapes)
    "granitehybrid": {"ssm_in.weight": "mamba.in_proj.weight", "ssm_in.bias": "mamba.in_proj.bias",
                      "ssm_conv1d.weight": "mamba.conv1d.weight", "ssm_conv1d.bias": "mamba.conv1d.bias",
                      "ssm_dt.bias": "mamba.dt_bias", "ssm_a": "mamba.A", "ssm_d": "mamba.D",
                      "ssm_norm.weight": "mamba.norm.weight", "ssm_out.weight": "mamba.out_proj.weight",
                      "ssm_out.bias": "mamba.out_proj.bias"},
    # gpt-oss: the router's bias, and each expert projection's biases stacked [experts, rows] (split per expert
    # by models/gpt_oss.py)
    "gpt-oss": {"ffn_gate_inp.bias": "mlp.gate.bias", "ffn_gate_exps.bias": "mlp.experts.gate_proj.bias",
                "ffn_up_exps.bias": "mlp.experts.up_proj.bias", "ffn_down_exps.bias": "mlp.experts.down_proj.bias"},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# metadata every decoder's GGUF file carries under its architecture's prefix
_REQUIRED_KEYS = ("embedding_length", "attention.head_count", "feed_forward_length", "block_count")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# (architecture, key) -> the key read where a file has none: Qwen3.5-MoE's config has no dense width, so the
# converter writes no feed_forward_length; the experts' stands in, unread (every layer is sparse), as for its
# config.json (gated_delta_config.gated_delta_dict)
_KEY_STAND_INS = {("qwen35moe", "feed_forward_length"): "expert_feed_forward_length"}
# [1, hidden] matrices that llama-quantize writes as vectors (ggml drops a shape's trailing 1s; the converter
# writes [1, hidden]): the shared expert's sigmoid gate of the Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE files
_ONE_ROW_MATRICES = ("mlp.shared_expert_gate.weight",)
# architectures whose Q/K rows llama.cpp's converter permutes (its LlamaModel and the models built on it)
_PERMUTED_QK = ("llama", "mistral", "smollm3", "granite", "granitemoe", "granitehybrid")
# read with the configuration (ModelArchConfig.rope_freq_factors, the longrope factors of rope_scaling), not weights
_ROPE_FREQS = "rope_freqs.weight"
_ROPE_FACTORS_LONG = "rope_factors_long.weight"
_ROPE_FACTORS_SHORT = "rope_factors_short.weight"
_CONFIG_TENSORS = (_ROPE_FREQS, _ROPE_FACTORS_LONG, _ROPE_FACTORS_SHORT)


_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


_U64 = struct.Struct("<Q")


class _Field:
    """A metadata value parsed straight to Python (``contents()``, as gguf's ``ReaderField`` gives it)."""

    __slots__ = ("name", "value", "types", "parts", "data")

    def __init__(self, name: str, value: object, types: list[GGUFValueType]) -> None:
        self.name, self.value, self.types = name, value, types
        is_array = types[0] == GGUFValueType.ARRAY
        self.data = value if is_array else [0]
        self.parts = [] if is_array else [np.asarray([value])]  # the reader reads general.alignment from here

    def contents(self) -> object:
        return self.value


def _string(buf: memoryview, offs: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offs)
    end = offs + 8 + n
    if end > len(buf):
        raise ValueError(f"a string at byte {offs} runs past the end of the file")
    return str(buf[offs + 8 : end], "utf-8"), end


def _value(buf: memoryview, offs: int, kind: int) -> tuple[object, list[GGUFValueType], int]:
    """(value, gguf's value types, the offset after it) of the value of type ``kind`` at ``offs``."""
    kind = GGUFValueType(kind)
    if kind == GGUFValueType.STRING:
        value, offs = _string(buf, offs)
        return value, [kind], offs
    if kind != GGUFValueType.ARRAY:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, offs)[0], [kind], offs + struct.calcsize(fmt)
    item, count = struct.unpack_from("<IQ", buf, offs)
    item = GGUFValueType(item)
    offs += 12
    if item in _SCALARS:
        dtype = np.dtype(_SCALARS[item])
        end = offs + count * dtype.itemsize
        if end > len(buf):
            raise ValueError(f"an array at byte {offs} runs past the end of the file")
        return np.frombuffer(buf, dtype, count, offs).tolist(), [kind, item], end
    if item == GGUFValueType.STRING:  # a vocabulary, merges: the loop that dominates, kept tight
        strings: list[str] = []
        length, size = _U64.unpack_from, len(buf)
        for _ in range(count):
            start = offs + 8
            offs = start + length(buf, offs)[0]
            if offs > size:
                raise ValueError(f"a string at byte {start - 8} runs past the end of the file")
            strings.append(str(buf[start:offs], "utf-8"))
        return strings, [kind, item], offs
    values: list[object] = []
    item_types: list[GGUFValueType] = [item]
    for _ in range(count):
        v, item_types, offs = _value(buf, offs, item)
        values.append(v)
    return values, [kind, *item_types], offs


class _Reader(GGUFReader):
    """gguf's reader with the metadata parsed by ``struct`` into Python values.

    gguf builds numpy views for every part of every value (~300k for a 49k
    vocabulary and its merges): seconds, where this takes a tenth of one.
    The tensors are gguf's own. A big-endian file is parsed by gguf.
    """

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I" or sys.byteorder != "little":
            return super()._build_fields(offs, count)
        buf = memoryview(self.data)
        for _ in range(int(count)):
            name, offs = _string(buf, offs)
            (kind,) = struct.unpack_from("<I", buf, offs)
            value, types, offs = _value(buf, offs + 4, kind)
            self._push_field(_Field(name, value, types), skip_sum=True)
        return offs


@functools.lru_cache(maxsize=2)
def open_reader(path: str) -> GGUFReader:
    """Parse a GGUF file once per load (the config, the tokenizer and the weights share it); data stays
    memory-mapped.

    ValueError naming the file when it cannot be parsed (truncated, corrupt, not GGUF).
    """
    try:
        # copy-on-write ("c"): the tensors are writable numpy views of the file, so a kept tensor is handed to
        # its layer without a private copy (a write would land in this process's own page, never the file)
        return _Reader(path, "c")
    except (ValueError, IndexError, KeyError, OSError, struct_error) as e:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """The file's metadata, key -> value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _field(reader: GGUFReader, key: str, default: object = None) -> object:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, object] | None:
    """The RoPE scaling of the GGUF metadata as the ``rope_parameters`` transformers' configs hold.

    The reverse of llama.cpp's converter (``convert_hf_to_gguf.py``), which
    writes a Hugging Face config's linear and yarn scaling as
    ``rope.scaling.*`` keys (``rope.scale_linear`` in older files). What has
    no transformers equivalent is refused rather than dropped.
    """
    def key(name: str) -> object:
        return _field(reader, f"{arch}.rope.{name}")

    kind = key("scaling.type")
    factor = key("scaling.factor")
    if kind is None and key("scale_linear") not in (None, 0.0, 1.0):
        kind, factor = "linear", key("scale_linear")  # llama.cpp's older key: a linear factor
    if kind in (None, "none"):
        return None
    if key("scaling.alpha") is not None:
        raise ValueError("GGUF rope.scaling.alpha (NTK-alpha RoPE) is not supported")
    attn_factor = key("scaling.attn_factor")
    if attn_factor is not None and float(attn_factor) != 1.0:
        # llama.cpp's extra cos/sin factor: transformers' linear and yarn have no such setting
        raise ValueError(f"GGUF RoPE with rope.scaling.attn_factor={attn_factor} is not supported (only 1.0 is)")
    if kind == "linear":
        if factor is None:
            raise ValueError("GGUF linear RoPE scaling without rope.scaling.factor")
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return _yarn_scaling(key, factor)
    # longrope's factors are tensors (rope_factors_long/short) of phi3 files, read by _phi3_settings
    raise ValueError(f"unsupported GGUF rope.scaling.type {kind!r}; supported: 'none', 'linear', 'yarn'")


def _yarn_scaling(key: Callable[[str], object], factor: object) -> dict[str, object]:
    if factor is None:
        raise ValueError("GGUF yarn RoPE scaling without rope.scaling.factor")
    scaling: dict[str, object] = {"rope_type": "yarn", "factor": float(factor)}
    original = key("scaling.original_context_length")
    if original is not None:  # else transformers' default, max_position_embeddings (llama.cpp's too)
        scaling["original_max_position_embeddings"] = int(original)
    # the converter writes transformers' attention_factor, beta_fast and beta_slow under these keys
    for gguf_key, name in (("scaling.yarn_attn_factor", "attention_factor"), ("scaling.yarn_beta_fast", "beta_fast"),
                           ("scaling.yarn_beta_slow", "beta_slow")):
        if key(gguf_key) is not None:
            scaling[name] = float(key(gguf_key))
    # llama.cpp-only knobs: transformers' YaRN has no extrapolation factor (it mixes fully, 1.0) and no
    # log multiplier (DeepSeek's mscale_all_dim)
    for gguf_key, neutral in (("scaling.yarn_ext_factor", 1.0), ("scaling.yarn_log_multiplier", 0.0)):
        value = key(gguf_key)
        if value is not None and float(value) != neutral:
            raise ValueError(f"GGUF yarn RoPE with rope.{gguf_key}={value} is not supported (transformers' "
                             f"YaRN has no such setting; only {neutral} is)")
    return scaling


def _rope_freq_factors(reader: GGUFReader) -> tuple[float, ...]:
    """The ``rope_freqs`` tensor's values: per rotated pair, the divisor of its RoPE frequency; () without one.

    llama.cpp's converter writes it in place of a Hugging Face ``llama3``
    scaling (Llama 3.1, 3.2, 3.3 and their fine-tunes), and no
    ``rope.scaling.*`` key for it. It is small (head size / 2 values), so it
    is read with the configuration; the RoPE table divides the frequencies by
    it (``layers/rotary.py``, which also checks its length and values).
    """
    return _small_tensor(reader, _ROPE_FREQS)


def _small_tensor(reader: GGUFReader, name: str) -> tuple[float, ...]:
    """The values of a small tensor read with the configuration (``_CONFIG_TENSORS``); () when the file has none."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return ()
    if tensor.data.nbytes != _expected_bytes(tensor):
        raise ValueError(f"GGUF tensor {name!r} holds {tensor.data.nbytes} bytes, its type and shape need "
                         f"{_expected_bytes(tensor)}: the file is truncated or corrupt")
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)
    return tuple(float(v) for v in values)


def _phi3_settings(reader: GGUFReader, head_dim: int, max_position: int) -> dict[str, Any]:
    """Phi-3's RoPE and window as llama.cpp's converter writes them (its ``Phi3MiniModel``).

    ``rope.dimension_count``: the rotated dimensions of a head (a partial
    rotation below ``head_dim``, Phi-4-mini's); ``rope_factors_short`` /
    ``rope_factors_long`` tensors: longrope's factors, with
    ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``
    (the converter's value of transformers' default attention factor);
    ``attention.sliding_window``: 0 for none, else every layer's window.
    """
    def key(name: str) -> object:
        return _field(reader, f"phi3.{name}")

    rope_dims = int(key("rope.dimension_count") or head_dim)
    partial = rope_dims / head_dim
    if int(head_dim * partial) != rope_dims:  # the factor transformers' int(head_dim * factor) turns back into it
        partial = float(np.nextafter(partial, 2.0))
    settings: dict[str, Any] = {"partial_rotary_factor": partial, "rope_scaling": None}
    long_factor, short_factor = _small_tensor(reader, _ROPE_FACTORS_LONG), _small_tensor(reader, _ROPE_FACTORS_SHORT)
    if long_factor or short_factor:
        if not (long_factor and short_factor):
            raise ValueError("GGUF phi3 file with one of rope_factors_long / rope_factors_short: longrope needs both")
        original = key("rope.scaling.original_context_length")
        if original is None:
            raise ValueError("GGUF phi3 longrope without phi3.rope.scaling.original_context_length")
        scaling = {"rope_type": "longrope", "short_factor": list(short_factor), "long_factor": list(long_factor),
                   "original_max_position_embeddings": int(original)}
        if key("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(key("rope.scaling.attn_factor"))
        settings["rope_scaling"] = scaling
    window = int(key("attention.sliding_window") or 0)
    if 0 < window < max_position:
        settings["sliding_windows"] = (window,) * int(key("block_count"))
        settings["layer_types"] = ("sliding_attention",) * int(key("block_count"))
    return settings


def read_config(reader: GGUFReader) -> ModelArchConfig:
    """Architecture facts from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"GGUF file has no general.architecture (got {arch!r})")
    def key(name: str, default: object = None) -> object:
        value = _field(reader, f"{arch}.{name}", default)
        stand_in = _KEY_STAND_INS.get((arch, name))
        return _field(reader, f"{arch}.{stand_in}") if value is None and stand_in else value

    missing = [f"{arch}.{k}" for k in _REQUIRED_KEYS if key(k) is None]
    if missing:
        raise ValueError(f"GGUF file (architecture {arch!r}) lacks {missing}")
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    check_unread_gguf_metadata(key, arch, int(key("attention.key_length", hidden // num_heads)))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per layer: a hybrid's state layers have none (LFM2's convs: 0)
        num_kv_heads = max(num_kv_heads)
    head_dim = int(key("attention.key_length", hidden // num_heads))
    if arch == "gemma4":  # the common fields hold its sliding layers' shape; the global ones' come after
        num_kv_heads, head_dim = gemma4_base_shape(key)
    vocab = key("vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise ValueError(f"GGUF file (architecture {arch!r}) has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    max_position = int(key("context_length", 2048))
    rope: dict[str, Any] = {"rope_scaling": None}
    if arch == "phi3":
        rope = _phi3_settings(reader, head_dim, max_position)
    else:
        rope["rope_scaling"] = _rope_scaling(reader, arch)
    config = ModelArchConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_freq_factors=_rope_freq_factors(reader),
        max_position_embeddings=max_position,
        tie_word_embeddings=not has_output,
        attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        qk_norm=any(t.name.endswith("attn_q_norm.weight") for t in reader.tensors),
        mlp_bias=any(t.name.endswith("ffn_gate.bias") for t in reader.tensors),
        num_experts=int(key("expert_count", 0) or 0),
        **gguf_moe_fields(key, arch, int(key("expert_count", 0) or 0), int(key("block_count")),
                          int(key("feed_forward_length")), (t.name for t in reader.tensors)),
        eos_token_ids=gguf_end_token_ids(metadata(reader)),  # EOS, EOT, EOM and end-of-turn controls
        checkpoint_format="gguf",
        **rope,
    )
    if arch == "lfm2":
        return lfm2_gguf_fields(config, key)
    if arch == "gemma4":
        return dataclasses.replace(config, **gemma4_gguf_settings(
            key, (t.name for t in reader.tensors), config.rope_freq_factors, max_position))
    if arch in GEMMA_ARCHITECTURES:
        return dataclasses.replace(config, **gemma_gguf_settings(
            key, arch, config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.head_dim,
            config.max_position_embeddings))
    if arch in QWEN35_ARCHITECTURES:
        return dataclasses.replace(config, **qwen35_gguf_settings(
            key, arch, config.num_hidden_layers, config.head_dim, (t.name for t in reader.tensors)))
    config = gguf_gpt_oss_fields(gguf_moe_family_fields(gguf_family_fields(config, key), key), key)
    return gguf_granite_hybrid_fields(config, key, (t.name for t in reader.tensors))


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (per head: interleaved -> halves)."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name_or_none(gguf_name: str, arch: str = "") -> str | None:
    m = _LAYER_RE.match(gguf_name)
    if m:
        suffix = _ARCH_LAYER_NAMES.get(arch, {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
        return None if suffix is None else f"model.layers.{m.group(1)}.{suffix}"
    if arch == "lfm2" and gguf_name == "token_embd_norm.weight":
        return "model.norm.weight"  # LFM2's final norm (transformers' embedding_norm)
    return _GLOBAL_NAMES.get(gguf_name)


def _hf_name(gguf_name: str, path: str, arch: str = "") -> str:
    name = _hf_name_or_none(gguf_name, arch)
    if name is None:
        raise ValueError(f"unexpected tensor {gguf_name!r} in {path}")
    return name


class GGUFWeights:
    """The tensors of a GGUF file under Hugging Face names, iterated once per load.

    ``quantized``: the 2-D tensors stored in another type than F32 (name ->
    ggml type number): the ones a model may take as stored, where it has
    kernels for their type. The model loader sets ``keep`` to the
    names its layers take as they are stored: those come out as their bytes,
    ``uint8 [rows, row bytes]``; and ``half`` to the names its layers hold in
    bfloat16 (types with no kernel, ``layers/quantization/gguf_dequantized.py``):
    those come out dequantized and rounded to bfloat16. Every other tensor is
    dequantized to float32.
    """

    def __init__(self, path: str, config: ModelArchConfig) -> None:
        self.path, self.config = path, config
        self.part_paths = model_part_paths(path)
        # a tensor with no Hugging Face name is refused when it is read, after the model registry has had its
        # say on the architecture (the clearer error for a family not supported)
        self.quantized: dict[str, int] = {
            expert_name: int(t.tensor_type)
            for part in self.part_paths
            for t in open_reader(part).tensors
            if len(t.shape) in (2, 3) and t.tensor_type != GGMLQuantizationType.F32
            and (name := _hf_name_or_none(t.name, config.architecture)) is not None
            for expert_name in (_expert_names(name, int(t.shape[2])) if _stacked_experts(name, t) else (name,))
        }
        if config.architecture in QWEN35_ARCHITECTURES:  # the gate rows the model splits from q_proj, as stored
            self.quantized.update(gated_query_types(self.quantized))
        self.keep: set[str] = set()
        self.half: set[str] = set()
        self.out_proj_untiled = False  # untile_out_proj

    def untile_out_proj(self) -> None:
        """Hand a qwen35 file's ``out_proj`` over with its value-head columns in grouped order, as a checkpoint
        holds them (tensor parallelism: a rank's heads one run of columns; ``ShardPlan.local_config``); those whose
        heads are not whole blocks of their type come out dequantized. Call it before the model is built."""
        cfg = self.config
        self.out_proj_untiled = True
        for name in columns_moved_in_values(self.quantized, cfg.architecture, cfg.linear_num_key_heads,
                                            cfg.linear_num_value_heads, cfg.linear_value_head_dim):
            del self.quantized[name]

    def _rows_in_hf_order(self, name: str, w: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's Q/K row permutation (rows are output channels, whole in either form)."""
        if self.config.architecture in _PERMUTED_QK:
            if ".q_proj." in name:
                return _unpermute_rope_rows(w, self.config.num_attention_heads)
            if ".k_proj." in name:
                return _unpermute_rope_rows(w, self.config.num_key_value_heads)
        return w

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        weights = (named for part in self.part_paths for named in self._iter_part(part))
        if cfg.architecture in QWEN35_ARCHITECTURES:
            # the Gated DeltaNet tensors with the checkpoint's values and order (loader/gguf_qwen35.py)
            weights = gguf_hf_values(weights, cfg.architecture, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                     cfg.linear_num_key_heads * cfg.linear_key_head_dim, self.out_proj_untiled)
        yield from weights

    def _iter_part(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of one file of the model (the only one, or one part of a split model)."""
        reader = open_reader(path)
        for t in _vocabulary_tensors_first(reader.tensors):
            if t.name in _CONFIG_TENSORS:
                continue  # the configuration's (rope_freq_factors, longrope's factors), applied to the RoPE table
            name = _hf_name(t.name, path, self.config.architecture)
            expected = _expected_bytes(t)
            if t.data.nbytes != expected:
                raise ValueError(f"{path}: tensor {t.name!r} holds {t.data.nbytes} bytes, its type "
                                 f"{t.tensor_type.name} and shape need {expected}: the file is truncated or corrupt")
            if _stacked_experts(name, t):
                yield from self._experts(name, t)
                _drop_mapped_pages(reader, t)
                continue
            if name in self.keep:
                # [rows, row bytes] as stored: gguf gives block types as bytes already, but F16 (F32, ...) as
                # values, which a dtype conversion would cast rather than reinterpret
                w = np.ascontiguousarray(t.data).view(np.uint8).reshape(t.data.shape[0], -1)
            else:
                w = _dequantized(t, path)
            if w.ndim == 1 and name.endswith(_ONE_ROW_MATRICES):
                w = w.reshape(1, -1)
            w = self._rows_in_hf_order(name, w)
            if not w.flags.writeable or not w.flags.c_contiguous:
                w = np.array(w, order="C")
            # a 2-byte copy where the layer holds one: half the bytes in flight, and the layer's values exactly
            yield name, torch.from_numpy(w).to(torch.bfloat16) if name in self.half else torch.from_numpy(w)
            # not held while the next is dequantized: a load holds one checkpoint tensor at a time
            del w
            _drop_mapped_pages(reader, t)
        # loaded: let go of the parsed metadata (~150 MB of numpy objects for a 49k vocabulary) and the
        # file's mapping, which would otherwise stay resident for the life of the process
        del reader, t
        open_reader.cache_clear()


    def _experts(self, name: str, t: object) -> Iterator[tuple[str, torch.Tensor]]:
        """A stacked experts' tensor ``[experts, rows, cols]`` one expert at a time, under per-expert names
        (a tensor of two projections, Gemma 4's gate_up, split into its halves): its rows as stored where the
        layer keeps them, else dequantized (one expert's copy at a time)."""
        num_experts = int(t.shape[2])
        names = _expert_names(name, num_experts)
        per_expert = len(names) // num_experts
        if names[0] in self.keep:
            stored = t.data.view(np.uint8).reshape(num_experts, t.data.shape[1], -1)  # [experts, rows, row bytes]
            for e, rows in enumerate(stored):
                for part, part_rows in zip(names[e * per_expert:(e + 1) * per_expert],
                                           np.split(rows, per_expert)):
                    yield part, torch.from_numpy(np.array(part_rows, order="C"))
            return
        values = _dequantized(t, self.path).reshape(num_experts, t.data.shape[1], -1)  # [experts, rows, cols]
        for e, rows in enumerate(values):
            for part, part_rows in zip(names[e * per_expert:(e + 1) * per_expert], np.split(rows, per_expert)):
                w = torch.from_numpy(np.array(part_rows, order="C"))
                yield part, w.to(torch.bfloat16) if part in self.half else w
        del values


def _stacked_experts(name: str, t: object) -> bool:
    """Whether tensor ``t`` (Hugging Face name ``name``) is one projection of every expert, ``[experts, rows, cols]``
    (``mlp.experts.*``; Gemma 4's ``experts.*`` beside its ``mlp``)."""
    return len(t.shape) == 3 and ".experts." in name


# a stacked tensor holding two projections of each expert, in row order (Gemma 4's gate_up: gate rows, then up)
_STACKED_PAIRS = {"gate_up_proj": ("gate_proj", "up_proj")}


def _expert_names(name: str, num_experts: int) -> tuple[str, ...]:
    """``model.layers.N.mlp.experts.<part>.weight`` -> expert ``e``'s ``model.layers.N.mlp.experts.{e}.<part>.weight``,
    expert by expert; a gate_up tensor gives each expert's gate then up name."""
    owner, _, part = name.partition(".experts.")
    proj, _, param = part.partition(".")
    parts = _STACKED_PAIRS.get(proj, (proj,))
    return tuple(f"{owner}.experts.{e}.{p}.{param}" for e in range(num_experts) for p in parts)


def _dequantized(t: object, path: str) -> np.ndarray:
    """Tensor ``t`` as float32 values (``gguf``'s dequantization); ValueError for a type it cannot
    dequantize (Q8_K and Q8_1 are llama.cpp's activation types: a file holding weights in them is refused)."""
    try:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {t.name!r} is of type {t.tensor_type.name}, which neither a kernel "
                         "here nor the gguf package's dequantization reads") from None


def _vocabulary_tensors_first(tensors: list) -> list:
    """The tensors outside the layers (the embedding, the LM head: a model's largest) first, then the layers'.

    A tensor's file pages are resident while it is copied, on top of what is loaded so far: taken first,
    the vocabulary tables' (430 MB for Llama 3.1 8B's Q6_K head) add to a near-empty process instead of
    to the finished model. The layers keep their file order (the page cache reads ahead).
    """
    return sorted(tensors, key=lambda t: _LAYER_RE.match(t.name) is not None)  # stable: file order otherwise


_FAULT_AROUND_BYTES = 2 << 20  # a multiple of the page size: the largest window one fault maps (a PMD)


def _drop_mapped_pages(reader: GGUFReader, t: object) -> None:
    """Let the file's pages of tensor ``t`` (copied by now) leave this process's resident memory.

    Read through the mapping, they would stay resident until the load ends: the
    whole file on top of the weights copied from it. They stay in the page cache,
    so a page shared with the next tensor is read back from memory, not disk.

    The range starts up to 2 MiB before the tensor: a page fault maps the page
    cache's pages around the faulting one too (fault-around, large folios), so
    reading this tensor's first page put the tail of the tensors before it back
    in the mapping, ~64 KiB a tensor (16 MB over the bundled file's 272).
    """
    mapping = getattr(reader.data, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = max(0, t.data_offset - _FAULT_AROUND_BYTES) // _FAULT_AROUND_BYTES * _FAULT_AROUND_BYTES
    end = min(t.data_offset + t.n_bytes, len(mapping))
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def _expected_bytes(t: object) -> int:
    """Bytes a tensor of its type and shape takes (gguf's block sizes)."""
    block, type_bytes = GGML_QUANT_SIZES[t.tensor_type]
    return int(np.prod(t.shape)) // block * type_bytes


def model_part_paths(path: str) -> list[str]:
    """The files of the model named by GGUF file ``path``: itself, or every part of a split model
    (``gguf_split.py``)."""
    fields = open_reader(path).fields
    split = {key: fields[key].contents() for key in ("split.count", "split.no") if key in fields}
    return split_part_paths(path, split)


def iter_weights(path: str, config: ModelArchConfig) -> GGUFWeights:
    """The file's tensors as ``(hf_name, tensor)``: float32, or bytes for the names set in ``keep``."""
    return GGUFWeights(path, config)
