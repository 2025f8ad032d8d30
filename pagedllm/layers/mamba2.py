"""The Mamba-2 mixer: a state-space layer keeping a fixed-size state per sequence instead of a KV cache.

For the step's rows ``x`` ``[num_tokens, hidden]`` (Hugging Face's
``GraniteMoeHybridMambaLayer`` / ``Mamba2Mixer``, named as they are)::

    z | xBC | dt = in_proj(x)                       [inter | inter + 2 G N | H]
    xBC = silu(causal depthwise conv1d(xBC))        over each sequence, from its conv state
    x | B | C = xBC                                 x: H heads of P; B, C: G groups of N
    y = SSD scan(x, dt, A = -exp(A_log), B, C, D, dt_bias)   from each sequence's SSM state
    y = rms_norm(y * silu(z)) * norm.weight         per group of inter / G channels
    out = out_proj(y)

The scan (``SsdScan``) runs the native kernels (``kernels/ssm/``): the
chunked form for prompts, the recurrent form for decodes (one token per
sequence), each updating its sequence's slot in place; the torch form runs
the recurrence token by token (the kernels' reference, and the path where
they are not built). The conv is the hybrid layers' shared one
(``layers/causal_conv1d.py``: its native op, or its torch twin). A captured
decode step (``DecodeMetadata``) reads the step as tensors only: the conv's
decode form and ``SsdScan.decode`` (``ssd_decode``, a step program node).

A layer's state is two tensors, one slot per running sequence (the engine's
state slots, ``AttentionMetadata.state_slots``; docs/hybrid-models.md): ``conv_state``
``[num_slots, conv_kernel - 1, conv_dim]`` (the last inputs of the conv,
oldest first) and ``ssm_state`` ``[num_slots, H, P, N]``, float32. A
sequence whose ``has_initial_state`` is False starts from zeros (a new
prompt); otherwise it continues from its slot (a later chunk of a prompt, a
decode, a prefix hit whose state was restored into the slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import AttentionMetadata, DecodeMetadata
from pagedllm.layers.causal_conv1d import causal_conv1d, causal_conv1d_decode
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.parallel import (
    RowParallelLinear,
    RowShardedParams,
    SegmentedColumnLinear,
    TensorParallelGroup,
)
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.weights import RowSpans

MambaState = tuple[torch.Tensor, torch.Tensor]  # (conv_state, ssm_state)


@dataclass(frozen=True)
class Mamba2Spec:
    """One Mamba-2 mixer's shape (Granite's ``mamba_*`` config fields).

    ``chunk_size``: the tokens the chunked scan moves the state by at once
    (at most the kernel's 256); ``dt_min`` / ``dt_max``: the time step's
    clamp (``time_step_limit``).
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    intermediate_size: int
    chunk_size: int = 256
    proj_bias: bool = False
    conv_bias: bool = True
    norm_eps: float = 1e-6
    dt_min: float = 0.0
    dt_max: float = math.inf

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(f"Mamba-2: {self.num_heads} heads of {self.head_dim} are not the intermediate size "
                             f"{self.intermediate_size}")
        if self.num_groups < 1 or self.num_heads % self.num_groups:
            raise ValueError(f"Mamba-2: {self.num_heads} heads do not split into {self.num_groups} groups")
        if not 1 <= self.conv_kernel <= 8:
            raise ValueError(f"Mamba-2: conv kernel {self.conv_kernel} is outside 1..8")
        if not 0.0 <= self.dt_min <= self.dt_max:
            raise ValueError(f"Mamba-2: time step limits must be 0 <= min <= max, got {self.dt_min}, {self.dt_max}")

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state and SSM state shapes (the per-sequence memory of the layer)."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)


@dataclass(frozen=True)
class StateStep:
    """A step's sequences as the state layers read them: token ranges, slots, fresh or continued."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    state_slots: torch.Tensor  # [num_seqs] int64
    has_initial_state: torch.Tensor  # [num_seqs] bool
    num_prefills: int  # sequences [0, num_prefills) may have several tokens; the rest have one each

    @classmethod
    def from_metadata(cls, meta: AttentionMetadata) -> StateStep:
        """Read off the step's metadata (ValueError where it has no state slots: not a hybrid step)."""
        slots = getattr(meta, "state_slots", None)
        initial = getattr(meta, "has_initial_state", None)
        if slots is None or initial is None:
            raise ValueError("a state layer's step needs state_slots and has_initial_state in its metadata")
        qsl = torch.tensor(meta.query_start_loc, dtype=torch.int64)
        # a "decode" of several tokens (a speculative draft's check) or from a zero state is scanned in the
        # chunked form: the recurrent kernel takes one token from the slot's state
        p = meta.num_prefills
        counts = qsl[1:] - qsl[:-1]
        recurrent = bool((counts[p:] == 1).all()) and bool(initial[p:].all())
        return cls(qsl, slots, initial, p if recurrent else len(meta.seq_lens))


def ssd_scan_torch(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A: torch.Tensor,  # noqa: N803
                   D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor, step: StateStep,  # noqa: N803
                   dt_limits: tuple[float, float]) -> torch.Tensor:
    """The scan token by token in torch: rows x ``[T, H*P]``, dt ``[T, H]``, B / C ``[T, G*N]``; the slots of
    ``ssm_state`` ``[num_slots, H, P, N]`` updated in place. The kernels' semantics (``kernels/ssm/ssd_scan.h``)."""
    num_heads, head_dim, state_size = ssm_state.shape[1:]
    per_group = num_heads // (B.shape[1] // state_size)
    steps = F.softplus(dt + dt_bias).clamp(*dt_limits)  # [T, H]
    out = torch.empty_like(x)
    bounds = step.query_start_loc.tolist()
    for i, slot in enumerate(step.state_slots.tolist()):
        s = ssm_state[slot] if bool(step.has_initial_state[i]) else ssm_state.new_zeros(ssm_state.shape[1:])
        for t in range(bounds[i], bounds[i + 1]):
            xt = x[t].view(num_heads, head_dim)
            bt = B[t].view(-1, state_size).repeat_interleave(per_group, 0)  # [H, N]
            ct = C[t].view(-1, state_size).repeat_interleave(per_group, 0)
            s = s * torch.exp(steps[t] * A)[:, None, None] + (steps[t][:, None] * xt)[:, :, None] * bt[:, None, :]
            out[t] = (torch.einsum("hpn,hn->hp", s, ct) + D[:, None] * xt).reshape(-1)
        ssm_state[slot] = s
    return out


class SsdScan(CustomOp):
    """The selective scan of one step: native kernels (chunked prompts, recurrent decodes) or torch."""

    def __init__(self, spec: Mamba2Spec) -> None:
        super().__init__()
        self.chunk_size = min(spec.chunk_size, 256)
        self.dt_limits = (spec.dt_min, spec.dt_max)

    def forward_torch(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
                      A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,  # noqa: N803
                      step: StateStep) -> torch.Tensor:
        """``ssd_scan_torch``."""
        return ssd_scan_torch(x, dt, B, C, A, D, dt_bias, ssm_state, step, self.dt_limits)

    def forward_native(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
                       A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,  # noqa: N803
                       step: StateStep) -> torch.Tensor:
        """The prompts' tokens through ``ssd_prefill``, the single-token decodes through ``ssd_decode``."""
        ops = torch.ops.pagedllm
        lo, hi = self.dt_limits
        split = int(step.query_start_loc[step.num_prefills])
        parts = []
        if step.num_prefills:
            p = step.num_prefills
            parts.append(ops.ssd_prefill(x[:split], dt[:split], B[:split], C[:split], A, D, dt_bias, ssm_state,
                                         step.state_slots[:p], step.query_start_loc[:p + 1],
                                         step.has_initial_state[:p], self.chunk_size, lo, hi))
        if split < x.shape[0]:
            parts.append(ops.ssd_decode(x[split:], dt[split:], B[split:], C[split:], A, D, dt_bias, ssm_state,
                                        step.state_slots[step.num_prefills:], lo, hi))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def decode(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
               A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,  # noqa: N803
               slots: torch.Tensor) -> torch.Tensor:
        """One token per sequence (row ``i``: slot ``slots[i]``), each continuing its state, with nothing of the
        step read into Python (a captured decode step): ``ssd_decode``, or the same recurrence in torch ops."""
        lo, hi = self.dt_limits
        if self.native is not None:
            return torch.ops.pagedllm.ssd_decode(x, dt, B, C, A, D, dt_bias, ssm_state, slots, lo, hi)
        n = x.shape[0]
        num_heads, head_dim, state_size = ssm_state.shape[1:]
        per_group = num_heads // (B.shape[1] // state_size)
        steps = F.softplus(dt + dt_bias).clamp(lo, hi)  # [n, H]
        xt = x.reshape(n, num_heads, head_dim)
        bt = B.reshape(n, -1, state_size).repeat_interleave(per_group, 1)  # [n, H, N]
        ct = C.reshape(n, -1, state_size).repeat_interleave(per_group, 1)
        s = ssm_state.index_select(0, slots)  # [n, H, P, N]
        s = s * torch.exp(steps * A)[:, :, None, None] + (steps[:, :, None] * xt)[..., None] * bt[:, :, None, :]
        ssm_state.index_copy_(0, slots, s)
        return (torch.einsum("shpn,shn->shp", s, ct) + D[None, :, None] * xt).reshape(n, -1)


def mamba_row_spans(spec: Mamba2Spec, tp: TensorParallelGroup | None) -> tuple[RowSpans, RowSpans, RowSpans]:
    """This process's rows of the checkpoint's ``in_proj`` (z | x | B | C | dt), of the conv's channels (x | B | C)
    and of the heads' channels (the gated norm's weight): under tensor parallelism (``spec`` a rank's) its heads'
    rows of z, x and dt and its groups' of B and C; else all of them."""
    inter, bc, heads = spec.intermediate_size, spec.num_groups * spec.state_size, spec.num_heads
    if tp is None or tp.size <= 1:
        return ((0, inter + spec.conv_dim + heads),), ((0, spec.conv_dim),), ((0, inter),)
    plan = tp.plan
    whole_inter, whole_bc = inter * plan.size, bc * plan.size  # heads and groups split evenly
    h0, g0 = plan.mamba_heads[0], plan.mamba_groups[0] * spec.state_size
    x0 = h0 * spec.head_dim
    conv = ((x0, inter), (whole_inter + g0, bc), (whole_inter + whole_bc + g0, bc))
    proj = ((x0, inter), *((whole_inter + start, rows) for start, rows in conv),
            (2 * whole_inter + 2 * whole_bc + h0, heads))
    return proj, conv, ((x0, inter),)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer (Hugging Face's ``mamba`` module of a layer); see the module docstring.

    Under tensor parallelism (``spec`` a rank's: its groups and the heads that read them) it holds their rows of
    ``in_proj``, the conv and the norm, their ``A_log`` / ``D`` / ``dt_bias`` and their state; ``out_proj`` is
    row-parallel (its heads' columns, the partial sums all-reduced). The gated norm's groups are whole on a rank.
    """

    def __init__(self, spec: Mamba2Spec, quant_config: QuantConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.spec = spec
        inter, heads = spec.intermediate_size, spec.num_heads
        proj_rows, conv_rows, head_rows = mamba_row_spans(spec, tp)
        self.in_proj = SegmentedColumnLinear(spec.hidden_size, proj_rows, spec.proj_bias, tp, quant_config,
                                             f"{prefix}.in_proj")
        # Hugging Face's nn.Conv1d names and shape: weight [conv_dim, 1, width]
        self.conv1d = RowShardedParams({"weight": (spec.conv_dim, 1, spec.conv_kernel),
                                        "bias": (spec.conv_dim,) if spec.conv_bias else None}, conv_rows, tp)
        self.dt_bias = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.norm = RowShardedParams({"weight": (inter,)}, head_rows, tp)
        # this rank's first head in the checkpoint's (None: one process, every head)
        self.first_head = tp.plan.mamba_heads[0] if tp is not None and tp.size > 1 else None
        self.out_proj = RowParallelLinear(inter, spec.hidden_size, spec.proj_bias, tp, head_rows[0][0], quant_config,
                                          f"{prefix}.out_proj")
        self.scan = SsdScan(spec)

    def checkpoint_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's heads of the checkpoint's ``dt_bias`` / ``A_log`` / ``D`` (one process: all of them)."""
        return tensor if self.first_head is None else tensor.narrow(0, self.first_head, self.spec.num_heads)

    def forward(self, x: torch.Tensor, state: MambaState, meta: AttentionMetadata) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``; each sequence's slots of ``state`` move on."""
        spec = self.spec
        conv_state, ssm_state = state
        # a captured decode step (DecodeMetadata) reads the step as tensors only: every row continues its slot
        step = None if isinstance(meta, DecodeMetadata) else StateStep.from_metadata(meta)
        inter, bc = spec.intermediate_size, spec.num_groups * spec.state_size
        proj = self.in_proj(x)
        z, xbc, dt = proj.split([inter, spec.conv_dim, spec.num_heads], dim=-1)
        xbc = self._conv(xbc, conv_state, meta, step)
        # column slices of xbc: the scan reads strided rows; its inputs in float32 (the state is)
        xs, b, c = xbc.float().split([inter, bc, bc], dim=-1)
        A = -torch.exp(self.A_log.float())  # noqa: N806
        if step is None:
            y = self.scan.decode(xs, dt.float(), b, c, A, self.D.float(), self.dt_bias.float(), ssm_state,
                                 meta.state_slots)
        else:
            y = self.scan(xs, dt.float(), b, c, A, self.D.float(), self.dt_bias.float(), ssm_state, step)
        return self.out_proj(self._gated_norm(y, z).to(x.dtype))

    def _conv(self, xbc: torch.Tensor, conv_state: torch.Tensor, meta: AttentionMetadata,
              step: StateStep | None) -> torch.Tensor:
        weight = self.conv1d.weight.view(self.spec.conv_dim, self.spec.conv_kernel)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        if step is None:  # a captured decode step
            return causal_conv1d_decode(xbc.float(), weight.float(), bias, conv_state, meta.state_slots, "silu",
                                        native=self.scan.native is not None)
        return causal_conv1d(xbc.float(), weight.float(), bias, conv_state, meta.query_start_loc, step.state_slots,
                             step.has_initial_state, "silu", native=self.scan.native is not None)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """rms_norm(y * silu(z)) * weight, the RMS taken over each group's channels, in float32."""
        spec = self.spec
        h = y * F.silu(z.float())
        groups = h.view(h.shape[0], spec.num_groups, -1)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + spec.norm_eps)
        return groups.view_as(h) * self.norm.weight.float()
