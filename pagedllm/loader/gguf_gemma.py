"""Gemma 2 and Gemma 3 (text) from GGUF files written by llama.cpp's ``convert_hf_to_gguf.py``.

What the converter writes, and what it leaves for the reader to assume as
llama.cpp does (``llama-model.cpp``'s hyperparameters for ``gemma2`` and
``gemma3``), read back into ``ModelArchConfig``'s Hugging Face terms:

- **Layer kinds.** No ``layer_types``: Gemma 2's even layers slide (every
  second layer is global), Gemma 3's every sixth is global, unless the file
  carries ``{arch}.attention.sliding_window_pattern`` (a period, or one
  bool per layer: true = sliding). The window is
  ``{arch}.attention.sliding_window`` (Gemma 2: 4096 without it; a Gemma 3
  file without it has no sliding layers: the converter leaves it out for
  ``sliding_window_pattern`` 1).
- **RoPE.** Gemma 2: ``rope.freq_base`` (10000 without it) for every layer.
  Gemma 3: ``rope.freq_base`` and the ``rope.scaling.*`` keys for global
  layers (read by ``gguf_loader``), ``rope.freq_base_swa`` (10000 without
  it, llama.cpp's fixed value) unscaled for sliding ones.
- **Score scale.** ``query_pre_attn_scalar`` is not written. llama.cpp
  scales by ``head_dim ** -0.5``, but for the 27B models (46 layers for
  Gemma 2, 62 for Gemma 3) by ``(hidden / heads) ** -0.5``: what every
  released checkpoint's ``query_pre_attn_scalar`` gives. An
  ``{arch}.attention.scale`` key, where a file has one, wins.
- **Softcaps.** Gemma 2: ``attn_logit_softcapping`` and
  ``final_logit_softcapping`` (50 and 30 without them, Gemma2Config's and
  llama.cpp's defaults), both applied. Gemma 3: the final one only, where
  written; scores are never capped.
- **Norms.** The converter writes every Gemma norm weight as ``1 + w``
  (Gemma's RMSNorm multiplies by ``1 + w``; llama.cpp's by the weight), so
  the families run a file's norms as plain ``w * x`` (``models/gemma2.py``,
  ``models/gemma3.py``). ``ffn_norm`` is the norm *before* the MLP here
  (Hugging Face's ``pre_feedforward_layernorm``; Llama's is its
  ``post_attention_layernorm``), ``post_attention_norm`` and
  ``post_ffw_norm`` the sandwich's after-norms (``GEMMA_LAYER_NAMES``).
- GELU (tanh approximation); embeddings scaled by ``sqrt(hidden)`` and the
  LM head tied to them where the file has no ``output.weight`` (both the
  families' own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# llama.cpp tensor names (after ``blk.N.``) that mean another Hugging Face module in Gemma's sandwich layers
GEMMA_LAYER_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# every how many layers one is global, where the file does not say (llama.cpp's set_swa_pattern)
_PATTERN = {"gemma2": 2, "gemma3": 6}
# the layer count of each family's 27B model, whose scores llama.cpp scales by (hidden / heads) ** -0.5
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_GEMMA2_WINDOW = 4096
_GEMMA2_SOFTCAPS = (50.0, 30.0)  # attention scores, final logits
_LOCAL_THETA = 10_000.0


def _layer_types(pattern: object, num_layers: int, arch: str) -> tuple[str, ...]:
    """Per-layer "sliding_attention" / "full_attention" from the file's pattern (None: the family's period)."""
    if pattern is None:
        pattern = _PATTERN[arch]
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"{num_layers} layers")
        return tuple("sliding_attention" if bool(p) else "full_attention" for p in pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern must be a positive period or one bool "
                         f"per layer, got {pattern!r}")
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _windows(key: Callable[[str], Any], arch: str, num_layers: int, max_position: int) -> dict[str, Any]:
    """``sliding_windows`` and ``layer_types`` of the file (see the module docstring)."""
    window = key("attention.sliding_window")
    if window is None and arch == "gemma2":
        window = _GEMMA2_WINDOW
    types = _layer_types(key("attention.sliding_window_pattern"), num_layers, arch)
    if window is None:
        types = ("full_attention",) * num_layers
    elif isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"GGUF {arch}.attention.sliding_window must be a positive number of tokens, got {window!r}")
    elif window >= max_position:
        window = None  # as from_hf_config: a window as long as the positions never masks anything
    return {"sliding_windows": tuple(window if t == "sliding_attention" else None for t in types),
            "layer_types": types}


def _attn_scale(key: Callable[[str], Any], arch: str, num_layers: int, hidden: int, heads: int,
                head_dim: int) -> float:
    scale = key("attention.scale")
    if scale is not None:
        return float(scale)
    if num_layers == _LAYERS_27B[arch]:
        return float(hidden // heads) ** -0.5
    return float(head_dim) ** -0.5


def _softcaps(key: Callable[[str], Any], arch: str) -> dict[str, float | None]:
    attn, final = key("attn_logit_softcapping"), key("final_logit_softcapping")
    if arch == "gemma2":
        attn = _GEMMA2_SOFTCAPS[0] if attn is None else attn
        final = _GEMMA2_SOFTCAPS[1] if final is None else final
    else:
        attn = None  # Gemma 3 never caps scores (nor does llama.cpp's gemma3 graph)
    return {"attn_logit_softcapping": None if attn is None else float(attn),
            "final_logit_softcapping": None if final is None else float(final)}


def gemma_gguf_settings(
    key: Callable[[str], Any], arch: str, num_layers: int, hidden: int, heads: int, head_dim: int, max_position: int,
) -> dict[str, Any]:
    """The ``ModelArchConfig`` fields a Gemma GGUF file's metadata sets beyond the common ones.

    ``key(name)`` reads ``{arch}.{name}`` (None where absent); the others
    are the fields already read. ValueError for a pattern or window that
    cannot be a Gemma model's.
    """
    if arch not in GEMMA_ARCHITECTURES:
        raise ValueError(f"gemma_gguf_settings reads {GEMMA_ARCHITECTURES}, not {arch!r}")
    settings: dict[str, Any] = {
        **_windows(key, arch, num_layers, max_position),
        **_softcaps(key, arch),
        "attn_scale": _attn_scale(key, arch, num_layers, hidden, heads, head_dim),
        "hidden_act": "gelu_pytorch_tanh",
    }
    if arch == "gemma3":
        local = key("rope.freq_base_swa")
        settings["local_rope_theta"] = _LOCAL_THETA if local is None else float(local)
    return settings
