"""Rotary position embeddings: inverse frequencies from transformers' RoPE initialisers, and cos/sin tables.

Every ``rope_type`` is computed by transformers' own
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (``default`` by
the formula transformers' models use for it), so the frequencies and the
attention factor are transformers' to the bit. What a per-position table
cannot hold is decided here, per type:

* ``dynamic`` (NTK): transformers recomputes the frequencies once the
  batch's longest sequence grows past ``max_position_embeddings`` (keeping
  the keys already cached as they were); up to that length they are the
  unscaled ones. The table covers positions ``< max_position_embeddings``
  only, and the engine refuses ``max_model_len`` above it, so every position
  pagedllm can reach gets transformers' frequencies exactly.
* ``longrope``: transformers takes ``short_factor`` for a forward whose
  largest position + 1 is at most ``original_max_position_embeddings``, and
  ``long_factor`` beyond, with one attention factor for both; the keys it
  has cached keep the rotation they were computed with. So a sequence's
  prompt (one forward) takes the long factors at every position when it is
  longer than the original length, the short ones otherwise, and each later
  token the long ones once its position reaches the original length. Such a
  model's table holds both sets, ``[short rows of positions 0 ..
  original-1; long rows of positions 0 .. max-1]``, and each token looks up
  its own row (``longrope_rows``: its position, plus the original length
  when it takes the long factors), so a batch mixing short and long
  sequences gives each its own. (Phi-3's ``generate`` in transformers also
  recomputes a sequence's whole cache once it crosses the original length;
  its model, with its cache, does not: pagedllm is the model.)

A partial rotation (``partial_rotary_factor`` below 1: Phi-4-mini's 0.75)
rotates the first ``int(head_dim * partial_rotary_factor)`` dimensions of
each head, rotate-half within them, and leaves the rest as they are, as
transformers' Phi-3 does; the tables then hold that many columns
(``rotary_dim``), and the attention factor scales the rotated part only.

A GGUF file of Llama 3.1 and later carries no ``rope_scaling``: llama.cpp's
converter turns the ``llama3`` scaling into a ``rope_freqs`` tensor, one
divisor per rotated pair, which llama.cpp divides each frequency by.
``freq_factors`` takes those divisors: the frequencies (the unscaled ones,
or a linear scaling's, which llama.cpp composes with them the same way) are
divided by them once, when the table is built. A ``llama3`` scaling (or any
other non-linear one) beside them would scale twice, and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagedllm.loader.model_config import check_rope_type, longrope_switch_len, rope_type_of

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

def _transformers_config(
    head_dim: int, max_position: int, theta: float, scaling: Mapping[str, Any] | None
) -> PreTrainedConfig:
    """A transformers config carrying only the RoPE facts, for ``ROPE_INIT_FUNCTIONS``.

    LlamaConfig because the initialisers read a config object (head size,
    ``max_position_embeddings``, ``rope_parameters``) and standardize its
    RoPE fields as every transformers model does; its validation is
    transformers' own (missing keys raise there).
    """
    from transformers import LlamaConfig

    params = {k: v for k, v in (scaling or {}).items() if k != "type"}
    params.update(rope_type=rope_type_of(scaling), rope_theta=float(theta))
    return LlamaConfig(
        hidden_size=head_dim, head_dim=head_dim, num_attention_heads=1, num_key_value_heads=1,
        intermediate_size=1, num_hidden_layers=1, vocab_size=1, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, max_position_embeddings=max_position, rope_parameters=params,
    )


def rope_parameters(
    head_dim: int, max_position: int, theta: float, scaling: Mapping[str, Any] | None,
    freq_factors: tuple[float, ...] = (), partial_rotary_factor: float = 1.0, long_factors: bool = False,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32, CPU) and the factor cos and sin are scaled by.

    ``max_position`` is the model's ``max_position_embeddings`` (yarn and
    longrope derive a missing ``factor`` from it, dynamic its threshold).
    Computed by transformers' ``ROPE_INIT_FUNCTIONS[rope_type]``; see the
    module docstring for the choices made for ``dynamic`` and ``longrope``.
    ``long_factors``: longrope's long set (transformers' for a sequence
    longer than the original length), else its short one; other types ignore it.
    ``freq_factors`` (a GGUF file's ``rope_freqs``, empty: none) divide the
    frequencies one by one afterwards. ``partial_rotary_factor``: the part
    of the head rotated (``rotary_dim = int(head_dim * factor)``, as
    transformers computes it); a scaling's own ``partial_rotary_factor`` is
    replaced by it. ValueError for an unknown rope_type, missing or bad
    parameters, frequencies of another count than ``rotary_dim // 2`` (a
    scaling that names a partial rotation this model does not take), or
    factors of the wrong count, not positive, or beside a scaling other than linear.
    """
    kind = check_rope_type(scaling)
    dim = rotary_dim(head_dim, partial_rotary_factor)
    divisors = _check_freq_factors(freq_factors, dim, kind)
    # the initialisers create some tensors on the default device: a model built on the meta device
    # would get meta frequencies
    with torch.device("cpu"):
        if kind == "default":
            # transformers' models compute the default themselves (compute_default_rope_parameters)
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            attention_factor = 1.0
        else:
            if partial_rotary_factor != 1.0:
                scaling = {**(scaling or {}), "partial_rotary_factor": partial_rotary_factor}
            inv_freq, attention_factor = _scaled_parameters(kind, head_dim, max_position, theta, scaling,
                                                            long_factors)
    if inv_freq.shape != (dim // 2,):
        raise ValueError(
            f"RoPE {kind!r} gives {inv_freq.numel()} frequencies where {dim} rotated dimensions of a head of "
            f"{head_dim} need {dim // 2}: a partial_rotary_factor in the scaling of a model that rotates "
            f"{'the whole head' if dim == head_dim else 'another part'}?"
        )
    if divisors is not None:
        # in float32, as llama.cpp divides each angle by its factor (theta / freq_factor)
        inv_freq = inv_freq.float() / divisors
    return inv_freq.float(), float(attention_factor)


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    """The dimensions of a head RoPE rotates, as transformers counts them; ValueError unless a positive even number."""
    if not 0.0 < partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor!r}")
    dim = int(head_dim * partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor {partial_rotary_factor} rotates {dim} of {head_dim} dimensions: "
                         "need an even number, at least 2")
    return dim


def _check_freq_factors(freq_factors: tuple[float, ...], head_dim: int, kind: str) -> torch.Tensor | None:
    """The divisors as a float32 tensor (None when there are none); ValueError where they cannot apply."""
    if not freq_factors:
        return None
    if kind not in ("default", "linear"):
        # llama3 is what the factors were computed from: applying both would scale twice
        raise ValueError(f"RoPE frequency factors (GGUF rope_freqs) cannot be combined with rope_type {kind!r}; "
                         "they replace a llama3 scaling and compose only with a linear one")
    if len(freq_factors) != head_dim // 2:
        raise ValueError(f"{len(freq_factors)} RoPE frequency factors (GGUF rope_freqs) for {head_dim} rotated "
                         f"dimensions: need one per rotated pair ({head_dim // 2})")
    divisors = torch.tensor(freq_factors, dtype=torch.float32, device="cpu")
    if not bool(torch.isfinite(divisors).all()) or not bool((divisors > 0).all()):
        raise ValueError(f"RoPE frequency factors (GGUF rope_freqs) must be positive and finite, got {freq_factors}")
    return divisors


def _scaled_parameters(
    kind: str, head_dim: int, max_position: int, theta: float, scaling: Mapping[str, Any] | None,
    long_factors: bool,
) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"RoPE scaling {kind!r} is not known to this transformers version")
    try:
        config = _transformers_config(head_dim, max_position, theta, scaling)
        seq_len = None
        if kind == "longrope" and long_factors:
            # the length transformers' dynamic update passes for the long set (any length past the original)
            seq_len = config.rope_parameters["original_max_position_embeddings"] + 1
        return ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), seq_len=seq_len)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bad RoPE scaling parameters for rope_type {kind!r} ({dict(scaling or {})}): {e}") from e


def longrope_rows(positions: np.ndarray, num_prompt_tokens: np.ndarray, switch_len: int) -> np.ndarray:
    """Each token's row of a two-set longrope table (``RotaryEmbedding``): ``[num_tokens]`` int64.

    ``positions`` ``[num_tokens]``; ``num_prompt_tokens`` ``[num_tokens]``:
    the prompt length of each token's sequence; ``switch_len``: the original
    length (``longrope_switch_len``). A token takes the long factors (row
    ``switch_len + position``) when its sequence's prompt is longer than
    ``switch_len`` (the prompt's forward, and everything after it, is long)
    or its own position + 1 is (the forward that computes it reaches past
    the original length); else the short ones (row ``position``). Decided
    per token, so chunked prefill, preemption and speculative verify steps
    rotate each token as one plain decoding would.
    """
    long = (positions >= switch_len) | (num_prompt_tokens > switch_len)
    return positions + switch_len * long


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table for every position.

    ``cos_sin`` looks the step's positions up once; every layer then applies
    the same pair. Rotate-half is written as a roll by half the head and a
    sign folded into the sin table (exact: only signs change)::

        rotate_half([x1, x2]) = [-x2, x1] = roll([x1, x2], half) * [-1, +1]

    ``scaling`` is the model's RoPE scaling dict (transformers'
    ``rope_parameters`` of a non-default type; any ``rope_type`` of
    ``SUPPORTED_ROPE_TYPES``): its frequencies come from ``rope_parameters``
    and both tables are scaled by its attention factor (yarn, longrope), as
    transformers scales cos and sin. ``max_position`` is the model's
    ``max_position_embeddings``: the table's length. ``freq_factors``: a
    GGUF file's ``rope_freqs`` divisors (see the module docstring).
    ``partial_rotary_factor``: the part of each head rotated; the tables
    then have ``rotary_dim`` columns, and ``apply_partial`` rotates the
    first ``rotary_dim`` dimensions of a head. ``switch_len``: where a
    longrope table's long rows start (None: one set; module docstring).
    """

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: Mapping[str, Any] | None,
        freq_factors: tuple[float, ...] = (), partial_rotary_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.settings = (head_dim, max_position, theta, scaling, tuple(freq_factors), partial_rotary_factor)
        self.rotary_dim = rotary_dim(head_dim, partial_rotary_factor)
        # longrope whose positions pass the original length: the table holds both sets (module docstring)
        self.switch_len = longrope_switch_len(scaling, max_position)
        # computed here so that bad parameters fail at load, and again by build_tables (cheap): the
        # frequencies are not kept, so no cast of the model rounds them and the weights hold only the tables
        rope_parameters(*self.settings)
        if self.switch_len is not None:
            rope_parameters(*self.settings, long_factors=True)
        num_rows = self._num_rows(max_position)
        self.register_buffer("cos", torch.empty(num_rows, self.rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(num_rows, self.rotary_dim), persistent=False)
        if self.cos.device.type != "meta":  # a model built on the meta device builds its tables once loaded
            self.build_tables()

    def _num_rows(self, num_positions: int) -> int:
        """Rows of a table of ``num_positions`` positions: one set, or a longrope model's short rows of the
        positions below the original length before its long rows of all of them."""
        if self.switch_len is None or num_positions <= self.switch_len:
            return num_positions  # no sequence passes the original length: the short set alone
        return self.switch_len + num_positions

    def build_tables(self, num_positions: int | None = None) -> None:
        """Fill the cos/sin tables (again after a model built on the meta device).

        ``num_positions``: the positions to build, the engine's ``max_model_len`` (no position reaches it),
        where that is fewer than ``max_position``: a 128k-position table of head size 128 is 134 MB of float32
        that a 4k-token engine never reads. The frequencies stay the model's (``settings``). A longrope
        table takes its short rows first, its long rows after (``longrope_rows``).
        """
        max_position = self.settings[1]
        if num_positions is not None:
            if num_positions < 1:
                raise ValueError(f"a RoPE table needs at least one position, got num_positions={num_positions}")
            max_position = min(max_position, num_positions)
        num_short = max_position if self.switch_len is None else min(max_position, self.switch_len)
        cos, sin = self._rows(num_short, long_factors=False)
        if self._num_rows(max_position) > max_position:  # the long rows, after the short ones
            long_cos, long_sin = self._rows(max_position, long_factors=True)
            cos, sin = torch.cat([cos, long_cos]), torch.cat([sin, long_sin])
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def _rows(self, num_positions: int, long_factors: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of positions ``0 .. num_positions-1`` (float32, CPU), scaled by the attention factor."""
        dim = self.rotary_dim
        inv_freq, attention_factor = rope_parameters(*self.settings, long_factors=long_factors)
        with torch.device("cpu"):
            freqs = torch.arange(num_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
            emb = torch.cat([freqs, freqs], dim=-1)  # [num_positions, rotary_dim]
            sign = torch.cat([-torch.ones(dim // 2), torch.ones(dim // 2)])  # [rotary_dim]
            # scaled in float32 before any cast, as transformers scales cos and sin
            return emb.cos() * attention_factor, emb.sin() * attention_factor * sign  # signed: see above

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for the step's tokens, each ``[num_tokens, 1, head_dim]``; ``positions`` are the
        tokens' rows (their positions, but for a two-set longrope table: ``longrope_rows``)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by its tokens' angles."""
        cos, sin = cos_sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

    @staticmethod
    def apply_partial(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate the first ``rotary_dim`` (the tables' width) dimensions of each head of ``x``; the rest pass."""
        dim = cos_sin[0].shape[-1]
        return torch.cat([RotaryEmbedding.apply(x[..., :dim], cos_sin), x[..., dim:]], dim=-1)


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: head size, positions covered, base, scaling, frequency divisors and the part of the head
    rotated (``RotaryEmbedding``'s arguments)."""

    head_dim: int
    max_position: int
    theta: float
    scaling: Mapping[str, Any] | None = None
    freq_factors: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head this table rotates."""
        return rotary_dim(self.head_dim, self.partial_rotary_factor)

    def build(self) -> RotaryEmbedding:
        """The table this spec describes."""
        return RotaryEmbedding(self.head_dim, self.max_position, self.theta, self.scaling, self.freq_factors,
                               self.partial_rotary_factor)


class RotaryTables(nn.Module):
    """A model's RoPE tables by name, one per way its layers rotate (Gemma 3: "full" and "local" bases).

    ``cos_sin`` looks the step's positions up once per table, for every
    layer that reads it; ``build_tables`` fills them all (the runner calls
    it after moving the model).
    """

    def __init__(self, specs: Mapping[str, RopeSpec]) -> None:
        super().__init__()
        self.tables = nn.ModuleDict({name: spec.build() for name, spec in specs.items()})
        switches = {table.switch_len for table in self.tables.values()}
        if len(switches) > 1:
            # one row per token serves every table: their layouts must agree
            raise ValueError(f"RoPE tables {list(specs)} switch to longrope's long factors at different lengths "
                             f"({sorted(switches, key=str)}): a model's tables must take the same rows")
        # the rows a step's tokens look up: their positions, or longrope_rows past this length (None: positions)
        self.switch_len: int | None = switches.pop() if switches else None

    def build_tables(self, num_positions: int | None = None) -> None:
        """Fill every cos/sin table (again after a model built on the meta device), ``num_positions`` rows at
        most (``RotaryEmbedding.build_tables``)."""
        for table in self.tables.values():
            table.build_tables(num_positions)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Table name -> cos and signed sin of the step's positions (``RotaryEmbedding.cos_sin``)."""
        return {name: table.cos_sin(positions, dtype) for name, table in self.tables.items()}
