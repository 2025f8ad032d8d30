"""Which slice of every weight a tensor-parallel rank holds (Megatron-style), and the model shape that leaves it.

Attention is split by KV-head groups: a rank takes whole groups (a KV head
and the query heads that read it), so no rank needs another's cache. When
the groups do not divide evenly the first ranks take one more (SmolLM2's 3
KV heads over 2 ranks: 2 + 1 groups, 6 + 3 query heads); vLLM refuses such
models. The MLP's intermediate rows and the vocabulary are split the same
way: as evenly as they go, the first ranks taking the remainder.

::

    hidden x  ──> qkv_proj  (rows: this rank's q, k, v heads)   column-parallel, no communication
              ──> attention over this rank's heads and KV cache
              ──> o_proj    (columns: the same heads)           row-parallel: partial sums, all-reduce
    hidden h  ──> gate_up   (rows: this rank's intermediate)    column-parallel
              ──> down_proj (columns: the same rows)            row-parallel: all-reduce
    embedding / LM head: this rank's vocabulary rows; lookups all-reduced, logits gathered to rank 0

A mixture of experts (``layers/fused_moe.py``) is split as its dense MLP:
each rank holds a slice of every expert's intermediate rows (``experts``:
gate/up rows column-parallel, down's input columns row-parallel), the
router replicated, and one all-reduce after the block. A GGUF file's
experts are split in whole quantization blocks of down's columns (256
weights where the expert size is a multiple of it, else 32: every block
type's size divides one of these), so a rank's slice of a row is whole
blocks; a split that leaves a rank no block is refused. docs/parallelism.md
says why this split and not whole experts per rank.

A hybrid model's state layers split by heads as vLLM's do, each rank keeping
the state of its heads only (its ``state_bytes_per_slot`` is its share):
Gated DeltaNet by key heads and the value heads that read them (``linear_k_heads``,
``linear_v_heads``: q, k, v rows of its input projection and conv channels,
z/b/a rows, the decay parameters), Mamba-2 by groups and the heads that read
them (``mamba_heads``, ``mamba_groups``), LFM2's short conv by channels
(``conv_channels``); each ends in a row-parallel ``out_proj``. Heads or groups
that do not divide by the ranks are refused (``state_layer_split``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedllm.loader.model_config import ModelArchConfig


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each of ``parts`` contiguous pieces of ``total``; the first ``total % parts`` one longer."""
    base, extra = divmod(total, parts)
    pieces, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        pieces.append((start, size))
        start += size
    return pieces


@dataclass(frozen=True)
class ShardPlan:
    """One rank's slices, in units of the full model: ``(start, size)`` of heads, intermediate rows, vocabulary."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary rows, for gathering logits
    head_dim: int
    # the whole model's counts, which a rank's local config no longer holds: for checkpoint tensors that store
    # every head's rows (Phi-3's fused qkv_proj) and norms that span every head (OLMo 2's q/k norms)
    total_q_heads: int
    total_kv_heads: int
    total_intermediate: int
    # a mixture of experts' slice of every expert's intermediate rows, and the whole expert's (0: no experts)
    expert_intermediate: tuple[int, int] = (0, 0)
    total_expert_intermediate: int = 0
    # the shared expert's slice (Qwen2-MoE), split like a routed expert's; (0, 0) without one
    shared_expert_intermediate: tuple[int, int] = (0, 0)
    # Gemma 4's global layers' own kv heads (``num_global_key_value_heads``): this rank's slice; (0, 0) without
    global_kv_heads: tuple[int, int] = (0, 0)
    # a hybrid model's state layers (state_layer_split): Gated DeltaNet's key and value heads, Mamba-2's heads and
    # groups, LFM2's short-conv channels; (0, 0) for a model without such layers
    linear_k_heads: tuple[int, int] = (0, 0)
    linear_v_heads: tuple[int, int] = (0, 0)
    mamba_heads: tuple[int, int] = (0, 0)
    mamba_groups: tuple[int, int] = (0, 0)
    conv_channels: tuple[int, int] = (0, 0)

    @classmethod
    def make(cls, cfg: ModelArchConfig, rank: int, size: int) -> ShardPlan:
        """The slices of rank ``rank`` of ``size``; ValueError when the model has fewer KV heads than ranks, or
        experts that do not split over them (``expert_split``), before any rank loads a weight."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
        if cfg.num_key_value_heads < size:
            raise ValueError(
                f"tensor_parallel_size={size} is more than the model's {cfg.num_key_value_heads} KV heads: every "
                "rank needs at least one whole KV-head group (KV heads are not replicated); use at most "
                f"{cfg.num_key_value_heads} ranks"
            )
        group = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per KV head
        kv = split_evenly(cfg.num_key_value_heads, size)[rank]
        vocab = split_evenly(cfg.vocab_size, size)
        return cls(
            rank=rank,
            size=size,
            q_heads=(kv[0] * group, kv[1] * group),
            kv_heads=kv,
            intermediate=split_evenly(cfg.intermediate_size, size)[rank],
            vocab=vocab[rank],
            vocab_sizes=tuple(n for _, n in vocab),
            head_dim=cfg.head_dim,
            total_q_heads=cfg.num_attention_heads,
            total_kv_heads=cfg.num_key_value_heads,
            total_intermediate=cfg.intermediate_size,
            expert_intermediate=expert_split(cfg, size)[rank] if cfg.num_experts else (0, 0),
            total_expert_intermediate=cfg.moe_intermediate_size if cfg.num_experts else 0,
            shared_expert_intermediate=shared_expert_split(cfg, size)[rank] if cfg.num_experts else (0, 0),
            global_kv_heads=global_kv_split(cfg, size)[rank],
            **{field: pieces[rank] for field, pieces in state_layer_split(cfg, size).items()},
        )

    def local_config(self, cfg: ModelArchConfig) -> ModelArchConfig:
        """``cfg`` with this rank's head counts and intermediate size: the shape its model and KV cache have."""
        if self.size == 1:
            return cfg
        return dataclasses.replace(
            cfg,
            num_attention_heads=self.q_heads[1],
            num_key_value_heads=self.kv_heads[1],
            intermediate_size=self.intermediate[1],
            moe_intermediate_size=self.expert_intermediate[1],
            shared_expert_intermediate_size=self.shared_expert_intermediate[1],
            num_global_key_value_heads=self.global_kv_heads[1],
            linear_num_key_heads=self.linear_k_heads[1] or cfg.linear_num_key_heads,
            linear_num_value_heads=self.linear_v_heads[1] or cfg.linear_num_value_heads,
            mamba=cfg.mamba if not self.mamba_heads[1] else dataclasses.replace(
                cfg.mamba, num_heads=self.mamba_heads[1], num_groups=self.mamba_groups[1],
                intermediate_size=self.mamba_heads[1] * cfg.mamba.head_dim),
            # a rank's value heads are one run of grouped out_proj columns, not of tiled ones: the GGUF loader
            # moves a qwen35 file's back (GGUFWeights.untile_out_proj)
            linear_out_proj_tiled=False,
        )

    @property
    def q_rows(self) -> tuple[int, int]:
        """``(start, size)`` of this rank's rows of ``q_proj`` (and columns of ``o_proj``)."""
        return self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim

    @property
    def total_q_size(self) -> int:
        """Rows of the whole model's ``q_proj``: every rank's q heads."""
        return self.total_q_heads * self.head_dim

    @property
    def total_kv_size(self) -> int:
        """Rows of the whole model's ``k_proj`` (and ``v_proj``): every rank's KV heads."""
        return self.total_kv_heads * self.head_dim

    @property
    def kv_rows(self) -> tuple[int, int]:
        """``(start, size)`` of this rank's rows of ``k_proj`` and ``v_proj``."""
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim


# GGUF block sizes are 32 (Q4_0 ... Q8_0, MXFP4) or 256 (the K-quants): a slice of a row in these units is whole
# blocks of any type the file holds
GGUF_EXPERT_UNITS = (256, 32)


def expert_split(cfg: ModelArchConfig, size: int) -> list[tuple[int, int]]:
    """``(start, size)`` of every rank's slice of each expert's intermediate rows (``cfg.moe_intermediate_size``).

    Float checkpoints split as evenly as they go; a GGUF file's in whole blocks of down's input columns (the
    largest unit of ``GGUF_EXPERT_UNITS`` dividing the expert size). ValueError when a rank would hold none.
    """
    return _rows_split(cfg, cfg.moe_intermediate_size, size, "each expert's")


def state_layer_split(cfg: ModelArchConfig, size: int) -> dict[str, list[tuple[int, int]]]:
    """Every rank's ``(start, size)`` of the state layers' heads, by ``ShardPlan`` field (none for a model
    without state layers).

    Gated DeltaNet: the key heads evenly, and with them the value heads that read them (value head ``h`` reads key
    head ``h / group``); Mamba-2: the groups of B and C evenly, and the heads that read them; LFM2's short conv:
    its channels (the hidden size) as evenly as they go. ValueError where the key heads or the groups do not
    divide by ``size``: a rank's heads must read its own key heads and groups only.
    """
    kinds = set(cfg.layer_types)
    out: dict[str, list[tuple[int, int]]] = {}
    if "linear_attention" in kinds:
        k, v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if k % size or v % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the Gated DeltaNet layers' {k} key heads "
                             f"and {v} value heads evenly: each rank holds whole key heads and the value heads that "
                             "read them; use a size that divides both")
        out["linear_k_heads"], out["linear_v_heads"] = split_evenly(k, size), split_evenly(v, size)
    if "mamba" in kinds and cfg.mamba is not None:
        heads, groups = cfg.mamba.num_heads, cfg.mamba.num_groups
        if heads % size or groups % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the Mamba-2 layers' {groups} groups and "
                             f"{heads} heads evenly: each rank holds whole groups of B and C and the heads that read "
                             "them; use a size that divides both")
        out["mamba_heads"], out["mamba_groups"] = split_evenly(heads, size), split_evenly(groups, size)
    if "conv" in kinds:
        out["conv_channels"] = split_evenly(cfg.hidden_size, size)
    return out


def global_kv_split(cfg: ModelArchConfig, size: int) -> list[tuple[int, int]]:
    """``(start, size)`` of every rank's slice of a Gemma 4 global layer's kv heads (``(0, 0)`` each for a model
    whose layers share one shape).

    A rank's query heads are the same slice in every layer (its o_proj columns are), so both kinds of layer must
    split their kv heads evenly: then each rank holds ``heads / size`` query heads and the kv heads they read in
    sliding and global layers alike. ValueError otherwise (Gemma 4 26B-A4B: 8 and 2 kv heads, 1 or 2 ranks).
    """
    total = cfg.num_global_key_value_heads
    if not total:
        return [(0, 0)] * size
    if cfg.num_key_value_heads % size or total % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the {cfg.num_key_value_heads} kv heads of the "
                         f"sliding layers and the {total} of the global layers evenly: a rank's query heads must be "
                         "the same slice in both kinds of layer; use a size that divides both")
    return split_evenly(total, size)


def shared_expert_split(cfg: ModelArchConfig, size: int) -> list[tuple[int, int]]:
    """``(start, size)`` of every rank's slice of the shared expert's intermediate rows (Qwen2-MoE's
    ``shared_expert_intermediate_size``; ``(0, 0)`` each without one), cut as ``expert_split`` cuts an expert's:
    the shared expert's partial sums join the routed experts' before the block's one all-reduce."""
    if not cfg.shared_expert_intermediate_size:
        return [(0, 0)] * size
    return _rows_split(cfg, cfg.shared_expert_intermediate_size, size, "the shared expert's")


def _rows_split(cfg: ModelArchConfig, inter: int, size: int, whose: str) -> list[tuple[int, int]]:
    unit = 1
    if cfg.checkpoint_format == "gguf":
        unit = next((u for u in GGUF_EXPERT_UNITS if inter % u == 0), 0)
        if not unit:
            raise ValueError(f"{whose} intermediate size {inter} is not whole GGUF blocks of 32 weights: "
                             "it cannot be split over tensor-parallel ranks")
    pieces = [(start * unit, n * unit) for start, n in split_evenly(inter // unit, size)]
    if any(n == 0 for _, n in pieces):
        what = f"{inter // unit} GGUF blocks of {unit}" if unit > 1 else f"{inter} rows"
        raise ValueError(f"tensor_parallel_size={size} is more than {whose} intermediate size holds "
                         f"({what}): every rank needs a slice of every expert; use at most {inter // unit} ranks")
    return pieces
