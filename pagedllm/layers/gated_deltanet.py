"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5 (3 of every 4 layers).

Per token, from the layer's input ``x``::

    q | k | v | z | b | a = in_proj(x)                 one matmul: [qkv (conv_dim), z (value_dim), b, a (num_v_heads)]
    q | k | v = silu(causal depthwise conv1d(q | k | v))   continuing the sequence's conv state
    g    = -exp(A_log) * softplus(a + dt_bias)           the log decay per value head
    beta = sigmoid(b)                                    the write strength
    o    = gated delta rule(l2norm(q), l2norm(k), v, g, beta)   continuing the recurrent state
    out  = out_proj(rms_norm(o) * w * silu(z))           per value head

Each sequence keeps two states (``state_shapes``): the conv's last
``kernel - 1`` inputs ``[kernel - 1, conv_dim]`` and the rule's
``[num_v_heads, head_k_dim, head_v_dim]``. The runner hands the layer both,
with a slot dimension in front, in the place an attention layer gets its
K/V cache; the step's metadata says which slot each sequence owns and
whether it continues one (``state_slots``, ``has_initial_state``).

The weights are Qwen3.5's (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``, loaded into the fused ``in_proj`` by ``fused_map``); Qwen3-Next
stores the same rows interleaved per key head (``in_proj_qkvz``,
``in_proj_ba``), which ``split_qwen3_next_projections`` rewrites into
Qwen3.5's names as the checkpoint streams in.

Under tensor parallelism (``distributed/shard_plan.py``) ``spec`` is a rank's:
its key heads and the value heads that read them. It holds their rows of q, k
and v (``qkv_row_spans``: three pieces of the checkpoint's ``in_proj_qkv``
rows and conv channels), of z, b and a, their ``A_log`` / ``dt_bias`` and its
state; the gated norm is per head (replicated), and ``out_proj`` is
row-parallel: its value heads' columns, the partial sums all-reduced.

The rule runs through ``torch.ops.pagedllm.gated_delta_prefill`` (chunks of
``chunk_size`` tokens) for a step's prompts and ``gated_delta_decode`` for its
decodes (``kernels/gated_delta/``); ``forward_torch`` runs the same
recurrence token by token in torch ops (no kernels, or another dtype). A
captured decode step (``DecodeMetadata``) reads the step as tensors only:
``causal_conv1d_decode`` and ``gated_delta_decode``, both step program nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import AttentionMetadata, DecodeMetadata
from pagedllm.layers.causal_conv1d import causal_conv1d, causal_conv1d_decode
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.linear import Linear
from pagedllm.layers.parallel import RowParallelLinear, RowShardedParams, TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.weights import FusedMap, RowSpans

L2_EPS = 1e-6  # the models' l2norm epsilon (inside the square root)


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """One Gated DeltaNet layer's shape (config.json's ``linear_*`` fields)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int
    norm_eps: float
    chunk_size: int = 64
    # out_proj's input columns hold the value heads tiled (value head h of key head h % num_k_heads), as
    # llama.cpp's converter writes a qwen35 file with more value than key heads: the layer hands out_proj its
    # heads in that order instead of the loader moving the file's columns (a head of 128 columns is half a
    # Q4_K block: moved, the layer would be widened to float32, 7x the bytes a decode step reads)
    out_proj_tiled: bool = False

    def __post_init__(self) -> None:
        sizes = (self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.conv_kernel_size)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"Gated DeltaNet head counts, head sizes and conv kernel must be positive, got {sizes}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")

    @property
    def key_dim(self) -> int:
        """q's (and k's) width: every key head."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """v's (and z's, and the output's) width: every value head."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The channels the conv runs over: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


def _sharded(tp: TensorParallelGroup | None) -> bool:
    return tp is not None and tp.size > 1


def whole_model_spec(spec: GatedDeltaNetSpec, size: int) -> GatedDeltaNetSpec:
    """The whole model's layer of which ``spec`` is one of ``size`` tensor-parallel ranks' (the key heads split
    evenly): the shape a checkpoint's tensors have. ``spec`` itself for one process."""
    if size == 1:
        return spec
    return dataclasses.replace(spec, num_k_heads=spec.num_k_heads * size, num_v_heads=spec.num_v_heads * size)


def qkv_row_spans(spec: GatedDeltaNetSpec, tp: TensorParallelGroup | None) -> RowSpans:
    """The rows of the checkpoint's q | k | v (``in_proj_qkv``'s rows, the conv's channels) this process holds:
    under tensor parallelism (``spec`` a rank's) its key heads' rows of q and of k and its value heads' of v,
    else all of them."""
    if not _sharded(tp):
        return ((0, spec.conv_dim),)
    plan = tp.plan
    whole_key_dim = spec.key_dim * plan.size  # the key heads split evenly (shard_plan.state_layer_split)
    q0 = plan.linear_k_heads[0] * spec.head_k_dim
    v0 = plan.linear_v_heads[0] * spec.head_v_dim
    return (q0, spec.key_dim), (whole_key_dim + q0, spec.key_dim), (2 * whole_key_dim + v0, spec.value_dim)


class GatedRMSNorm(CustomOp):
    """``rms_norm(x) * weight * silu(gate)`` per value head (``[head_v_dim]`` weight), in float32, the heads
    flattened: ``[num_tokens, num_heads, head_dim]`` twice -> ``[num_tokens, num_heads * head_dim]``.

    ``tiled_k_heads`` > 0: the heads come out tiled over that many key heads (head ``k * group + g`` at
    ``g * tiled_k_heads + k``), the order of a converted qwen35 file's out_proj columns
    (``GatedDeltaNetSpec.out_proj_tiled``). Natively one pass per row (``torch.ops.pagedllm.gated_rms_norm``,
    a node of a captured decode step's program) instead of about ten torch ops.
    """

    def __init__(self, dim: int, eps: float, tiled_k_heads: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.tiled_k_heads = tiled_k_heads

    def forward_torch(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """In torch ops, in ``x``'s dtype."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        o = ((self.weight * normed.to(x.dtype)).float() * F.silu(gate.float())).to(x.dtype)
        if self.tiled_k_heads:
            # grouped (k, g) -> tiled (g, k)
            o = o.view(o.shape[0], self.tiled_k_heads, o.shape[1] // self.tiled_k_heads, o.shape[-1]).transpose(1, 2)
        return o.flatten(1)

    def forward_native(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """One native pass (float32)."""
        return self.native.gated_rms_norm(x, gate, self.weight, self.eps, self.tiled_k_heads)


class GatedDeltaNet(CustomOp):
    """The layer (``linear_attn`` in the checkpoints); ``forward(x, states, meta)`` -> ``[num_tokens, hidden]``."""

    def __init__(
        self, spec: GatedDeltaNetSpec, quant_config: QuantConfig | None = None, prefix: str = "",
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        s = spec
        self.in_proj = Linear(s.hidden_size, s.conv_dim + s.value_dim + 2 * s.num_v_heads, False, quant_config,
                              f"{prefix}.in_proj")
        # the depthwise conv's weight under the checkpoint's name (conv1d.weight [conv_dim, 1, kernel])
        self.conv1d = RowShardedParams({"weight": (s.conv_dim, 1, s.conv_kernel_size)}, qkv_row_spans(s, tp), tp)
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads), requires_grad=False)
        tiled = s.num_k_heads if s.out_proj_tiled and s.num_v_heads > s.num_k_heads else 0
        self.norm = GatedRMSNorm(s.head_v_dim, s.norm_eps, tiled)
        # this rank's first value head in the checkpoint's (None: one process, every head)
        self.first_v_head = tp.plan.linear_v_heads[0] if _sharded(tp) else None
        if self.first_v_head is not None and tiled:  # a rank's heads are not one run of tiled columns
            raise ValueError("a Gated DeltaNet layer whose out_proj columns are tiled is not split over "
                             "tensor-parallel ranks (the loader moves them back to grouped order first)")
        v_start = (self.first_v_head or 0) * s.head_v_dim
        self.out_proj = RowParallelLinear(s.value_dim, s.hidden_size, False, tp, v_start, quant_config,
                                          f"{prefix}.out_proj")

    def checkpoint_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's value heads of the checkpoint's ``A_log`` / ``dt_bias`` (one process: all of them)."""
        if self.first_v_head is None:
            return tensor
        return tensor.narrow(0, self.first_v_head, self.spec.num_v_heads)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's states: the conv's last inputs, then the rule's state."""
        s = self.spec
        return (s.conv_kernel_size - 1, s.conv_dim), (s.num_v_heads, s.head_k_dim, s.head_v_dim)

    @staticmethod
    def fused_map(spec: GatedDeltaNetSpec, tp: TensorParallelGroup | None = None) -> FusedMap:
        """Where Qwen3.5's separate input projections go in ``in_proj`` (``spec``: this process's), and under
        tensor parallelism which rows of each a rank takes: its pieces of q | k | v, its value heads' z, b, a."""
        s = spec
        z_at = s.conv_dim
        b_at = z_at + s.value_dim
        qkv = v_head = v_row = None
        if _sharded(tp):
            qkv, v_head = qkv_row_spans(s, tp), tp.plan.linear_v_heads[0]
            v_row = v_head * s.head_v_dim
        return {
            "in_proj_qkv": ("in_proj", 0, s.conv_dim, qkv),
            "in_proj_z": ("in_proj", z_at, s.value_dim, v_row),
            "in_proj_b": ("in_proj", b_at, s.num_v_heads, v_head),
            "in_proj_a": ("in_proj", b_at + s.num_v_heads, s.num_v_heads, v_head),
        }

    def _inputs(
        self, x: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        """q, k, v (views of the conv's output), z, g and beta of the step's tokens."""
        s = self.spec
        proj = self.in_proj(x)  # [num_tokens, conv_dim + value_dim + 2 * num_v_heads]
        weight = self.conv1d.weight.view(s.conv_dim, s.conv_kernel_size)
        if isinstance(meta, DecodeMetadata):  # a captured decode step: the step's sizes stay tensors
            mixed = causal_conv1d_decode(proj[:, : s.conv_dim], weight, None, states[0], meta.state_slots, "silu",
                                         native=self.native is not None)
        else:
            mixed = causal_conv1d(proj[:, : s.conv_dim], weight, None, states[0], meta.query_start_loc,
                                  meta.state_slots, meta.has_initial_state, "silu", native=self.native is not None)
        n = x.shape[0]
        q = mixed[:, : s.key_dim].view(n, s.num_k_heads, s.head_k_dim)
        k = mixed[:, s.key_dim : 2 * s.key_dim].view(n, s.num_k_heads, s.head_k_dim)
        v = mixed[:, 2 * s.key_dim :].view(n, s.num_v_heads, s.head_v_dim)
        z = proj[:, s.conv_dim : s.conv_dim + s.value_dim].view(n, s.num_v_heads, s.head_v_dim)
        b, a = proj[:, s.conv_dim + s.value_dim :].float().split(s.num_v_heads, dim=1)
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        return q, k, v, z, g.contiguous(), b.sigmoid().contiguous()

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj of the gated norm of the rule's output ``core`` ``[num_tokens, num_v_heads, head_v_dim]`` (its
        heads in the order of out_proj's columns: tiled where ``out_proj_tiled``)."""
        return self.out_proj(self.norm(core, z))

    def forward_native(
        self, x: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The rule through the native kernels: prompts chunked, decodes recurrent (float32 on the CPU)."""
        q, k, v, z, g, beta = self._inputs(x, states, meta)
        core = torch.empty_like(v)  # [num_tokens, num_v_heads, head_v_dim]
        scale = self.spec.head_k_dim**-0.5
        if isinstance(meta, DecodeMetadata):  # a captured decode step: every row continues its slot
            self.native.gated_delta_decode(q, k, v, g, beta, states[1], meta.state_slots, core, scale)
            return self._output(core, z)
        loc, num_prefills, rec = meta.query_start_loc, meta.num_prefills, states[1]
        if num_prefills:
            end = loc[num_prefills]
            bounds = torch.tensor([b for i in range(num_prefills) for b in (loc[i], loc[i + 1])], dtype=torch.int64)
            self.native.gated_delta_prefill(q[:end], k[:end], v[:end], g[:end], beta[:end], rec, bounds,
                                            meta.state_slots[:num_prefills], meta.has_initial_state[:num_prefills],
                                            core[:end], scale, self.spec.chunk_size)
        start = loc[num_prefills]
        if start < x.shape[0]:  # one token each, after the prompts: decodes, or prompts of a single token
            slots, initial = meta.state_slots[num_prefills:], meta.has_initial_state[num_prefills:]
            if not bool(initial.all()):  # a one-token prompt starts from zero, not from the slot's last owner
                rec[slots[~initial]] = 0.0
            self.native.gated_delta_decode(q[start:], k[start:], v[start:], g[start:], beta[start:], rec, slots,
                                           core[start:], scale)
        return self._output(core, z)

    def forward_torch(
        self, x: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The rule token by token in torch ops (float32 state, any activations' dtype)."""
        if isinstance(meta, DecodeMetadata):
            # the loop below reads the step's sequences into Python, which a trace cannot: say so plainly
            # (the capture gives up with this message; the native form is the one captured)
            raise ValueError("Gated DeltaNet's torch form is not traced for captured decode steps: "
                             "it reads the step's sizes into Python (the native kernels are captured)")
        q, k, v, z, g, beta = self._inputs(x, states, meta)
        core = torch.empty_like(v)
        loc, rec = meta.query_start_loc, states[1]
        slots, initial = meta.state_slots.tolist(), meta.has_initial_state.tolist()
        for i, slot in enumerate(slots):
            rows = slice(loc[i], loc[i + 1])
            state = rec[slot] if initial[i] else torch.zeros_like(rec[slot])
            core[rows], rec[slot] = gated_delta_torch(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
        return self._output(core, z)


def gated_delta_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the rule, token by token, in float32 with L2-normed q and k.

    q, k ``[T, num_k_heads, head_k_dim]``, v ``[T, num_v_heads, head_v_dim]``, g and beta ``[T, num_v_heads]``,
    state ``[num_v_heads, head_k_dim, head_v_dim]``; returns (out ``[T, num_v_heads, head_v_dim]`` in v's dtype,
    the state after the last token).
    """
    group = v.shape[1] // q.shape[1]
    q, k = (t.float().repeat_interleave(group, dim=1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    state = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        state.mul_(g[t].float().exp()[:, None, None])
        delta = beta[t].float()[:, None] * (v[t].float() - torch.einsum("hkv,hk->hv", state, k[t]))
        state.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out.to(v.dtype), state


def split_qwen3_next_projections(
    weights: Iterable[tuple[str, torch.Tensor]], spec: GatedDeltaNetSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's interleaved ``in_proj_qkvz`` / ``in_proj_ba`` as Qwen3.5's ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a`` (other tensors pass through).

    Qwen3-Next groups the rows per key head: for each of the ``num_k_heads``,
    its q rows, k rows, then the v rows and z rows of its ``num_v_heads /
    num_k_heads`` value heads; ``in_proj_ba`` likewise b then a per key head.
    """
    s = spec
    group = s.num_v_heads // s.num_k_heads
    for name, tensor in weights:
        owner, _, param = name.rpartition(".")
        module, _, last = owner.rpartition(".")
        if last == "in_proj_qkvz":
            parts = tensor.reshape(s.num_k_heads, -1, *tensor.shape[1:]).split(
                [s.head_k_dim, s.head_k_dim, group * s.head_v_dim, group * s.head_v_dim], dim=1)
            q, k, v, z = (p.reshape(-1, *tensor.shape[1:]) for p in parts)
            yield f"{module}.in_proj_qkv.{param}", torch.cat([q, k, v])
            yield f"{module}.in_proj_z.{param}", z
        elif last == "in_proj_ba":
            b, a = (p.reshape(-1, *tensor.shape[1:])
                    for p in tensor.reshape(s.num_k_heads, -1, *tensor.shape[1:]).split([group, group], dim=1))
            yield f"{module}.in_proj_b.{param}", b
            yield f"{module}.in_proj_a.{param}", a
        else:
            yield name, tensor
