"""Linear layers and embeddings over GGUF's quantized blocks, kept as the file stores them.

A GGUF tensor of type Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, F16 or BF16 is
held as its bytes, ``qweight`` ``[rows, in_features / block weights * block
bytes]`` uint8 (one row per output channel, its blocks back to back), and
multiplied by
``kernels/gguf_linear.cpp``, which dequantizes in registers and a
cache-sized strip at a time: nothing float32 of the weight is kept. The
bundled SmolLM2 (Q4_1 layers, a Q8_0 embedding tied to the LM head) holds
~98 MB of weights this way against 538 MB dequantized.

``use_gguf_weights`` prepares a model built on the meta device for such a
checkpoint: the layers whose checkpoint tensors are all quantized in one
type get a ``GGUFLinearMethod`` and a ``qweight`` buffer of the right size in
place of their float weight; the token embedding becomes a
``GGUFEmbedding``; a tied LM head shares the embedding's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pagedllm.layers.linear import Linear, LinearMethod, replace_parameter
from pagedllm.layers.parallel import TensorParallelGroup, vocab_parallel_lookup

# ggml's type numbers -> (name, weights per block, bytes per block): the types kernels/gguf_blocks.h reads
GGUF_KERNEL_TYPES: dict[int, tuple[str, int, int]] = {
    1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
    # the same types interleaved 16 rows at a time (GGUF_INTERLEAVED below): the same blocks
    514: ("Q4_0", 32, 18), 515: ("Q4_1", 32, 20), 518: ("Q5_0", 32, 22), 519: ("Q5_1", 32, 24),
    520: ("Q8_0", 32, 34), 522: ("Q2_K", 256, 84),
    523: ("Q3_K", 256, 110), 524: ("Q4_K", 256, 144), 525: ("Q5_K", 256, 176), 526: ("Q6_K", 256, 210),
}
GGUF_BLOCK = 32  # every row the kernels take is whole runs of 32 weights (vector loads)
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants Q2_K to Q6_K interleaved 16 rows at a time (kernels/gguf_x16.h):
# ggml type -> the kernels' number for it
GGUF_INTERLEAVED: dict[int, int] = {t: 512 + t for t in (2, 3, 6, 7, 8, 10, 11, 12, 13, 14)}
INTERLEAVE_ROWS = 16

# checkpoint part -> (fused parameter, row offset, rows, checkpoint's first row), as layers/weights.py's FusedMap
FusedMap = Mapping[str, tuple[str, int, int, int | None]]


def gguf_row_bytes(ggml_type: int, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights in ``ggml_type``; ValueError for a type with no kernel."""
    if ggml_type not in GGUF_KERNEL_TYPES:
        raise ValueError(f"no GGUF kernel for tensor type {ggml_type}; kernels exist for "
                         f"{sorted(name for name, _, _ in GGUF_KERNEL_TYPES.values())}")
    name, block_weights, block_bytes = GGUF_KERNEL_TYPES[ggml_type]
    if in_features % max(block_weights, GGUF_BLOCK):
        raise ValueError(f"a {name} row of {in_features} weights is not whole runs of {max(block_weights, GGUF_BLOCK)}")
    return in_features // block_weights * block_bytes


def gguf_kernel_takes(ggml_type: int, in_features: int) -> bool:
    """Whether the kernels multiply rows of ``in_features`` weights stored in ``ggml_type``."""
    try:
        gguf_row_bytes(ggml_type, in_features)
    except ValueError:
        return False
    return True


class GGUFLinearMethod(LinearMethod):
    """``layer.qweight`` in GGUF blocks of ``ggml_type``, multiplied by the native GGUF kernel (float32 in and out)."""

    def __init__(self, ggml_type: int) -> None:
        if ggml_type not in GGUF_KERNEL_TYPES:
            gguf_row_bytes(ggml_type, GGUF_BLOCK)  # raises, naming the types with a kernel
        self.ggml_type = ggml_type
        interleaved = "-x16" if ggml_type in GGUF_INTERLEAVED.values() else ""
        self.name = f"gguf-{GGUF_KERNEL_TYPES[ggml_type][0].lower()}{interleaved}"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"GGUF linear layers compute in float32, got {x.dtype}")
        rows = x.reshape(-1, layer.in_features).contiguous()  # [num_rows, in_features]
        out = torch.ops.pagedllm.gguf_linear(rows, layer.qweight, self.ggml_type, layer.in_features, layer.bias)
        return out.view(*x.shape[:-1], layer.out_features)


class GGUFPartsLinearMethod(LinearMethod):
    """A fused layer (q/k/v, gate/up) whose checkpoint parts a GGUF file stores in different types.

    A Q4_K_M file keeps some layers' v_proj in Q6_K beside Q4_K q/k: each
    part's rows stay in its own type, one part after another in one flat
    buffer, ``layer.qweight`` uint8 ``[sum of the parts' bytes]``::

        qweight   [ q rows (Q4_K) | k rows (Q4_K) | v rows (Q6_K) ]
        y         [ y_q           | y_k           | y_v           ]   one gguf_linear each, joined

    ``parts``: ``(row offset, rows, ggml type)`` of each part, by offset, covering the layer's rows.
    """

    def __init__(self, parts: list[tuple[int, int, int]], in_features: int) -> None:
        self.in_features = in_features
        self.parts: list[tuple[int, int, int]] = []
        self.byte_offsets: list[int] = []
        start = 0
        for offset, rows, ggml_type in sorted(parts):
            if offset != (self.parts[-1][0] + self.parts[-1][1] if self.parts else 0):
                raise ValueError(f"the parts of a fused GGUF layer must cover its rows in turn, got {sorted(parts)}")
            self.parts.append((offset, rows, ggml_type))
            self.byte_offsets.append(start)
            start += rows * gguf_row_bytes(ggml_type, in_features)
        self.num_bytes = start
        self._name()

    def _name(self) -> None:
        self.name = "gguf-" + "+".join(
            GGUF_KERNEL_TYPES[t][0].lower() + ("-x16" if t in GGUF_INTERLEAVED.values() else "") for _, _, t in self.parts
        )

    def part_weight(self, layer: Linear, index: int) -> torch.Tensor:
        """Part ``index``'s blocks: a uint8 ``[rows, row bytes]`` view of ``layer.qweight``."""
        _, rows, ggml_type = self.parts[index]
        row_bytes = gguf_row_bytes(ggml_type, self.in_features)
        return layer.qweight.narrow(0, self.byte_offsets[index], rows * row_bytes).view(rows, row_bytes)

    def qweight_rows(self, layer: Linear, offset: int, rows: int) -> torch.Tensor:
        """Where the checkpoint part for rows ``[offset, offset + rows)`` is loaded (layers/weights.py)."""
        for i, (start, size, _) in enumerate(self.parts):
            if (start, size) == (offset, rows):
                return self.part_weight(layer, i)
        raise ValueError(f"no part of rows {offset}..{offset + rows} in {self.parts}")

    def interleave(self, layer: Linear) -> int:
        """Interleave each part whose type has an x16 layout and whose rows are a multiple of 16; returns how many."""
        count = 0
        for i, (offset, rows, ggml_type) in enumerate(self.parts):
            if ggml_type in GGUF_INTERLEAVED and rows % INTERLEAVE_ROWS == 0:
                torch.ops.pagedllm.gguf_interleave_(self.part_weight(layer, i), ggml_type, self.in_features)
                self.parts[i] = (offset, rows, GGUF_INTERLEAVED[ggml_type])
                count += 1
        self._name()
        return count

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"GGUF linear layers compute in float32, got {x.dtype}")
        rows = x.reshape(-1, layer.in_features).contiguous()  # [num_rows, in_features]
        outs = []
        for i, (offset, size, ggml_type) in enumerate(self.parts):
            bias = None if layer.bias is None else layer.bias.narrow(0, offset, size)
            outs.append(torch.ops.pagedllm.gguf_linear(rows, self.part_weight(layer, i), ggml_type,
                                                       layer.in_features, bias))  # [num_rows, size]
        return torch.cat(outs, dim=-1).view(*x.shape[:-1], layer.out_features)


class GGUFEmbedding(nn.Module):
    """A token embedding whose table stays in GGUF blocks; looked-up rows come out float32.

    Under tensor parallelism (``tp``) it holds vocabulary rows ``[vocab_start,
    vocab_start + num_embeddings)`` and looks up as ``VocabParallelEmbedding`` does.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, ggml_type: int,
        tp: TensorParallelGroup | None = None, vocab_start: int = 0,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.ggml_type = num_embeddings, embedding_dim, ggml_type
        self.tp, self.vocab_start = tp, vocab_start
        row_bytes = gguf_row_bytes(ggml_type, embedding_dim)
        self.register_buffer("qweight", torch.empty(num_embeddings, row_bytes, dtype=torch.uint8))  # [vocab, bytes]

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).contiguous()  # [num_tokens]
        out = torch.ops.pagedllm.gguf_embedding(self.qweight, self.ggml_type, self.embedding_dim, ids)
        return out.view(*input_ids.shape, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.tp.size == 1:
            return self._lookup(input_ids)
        return vocab_parallel_lookup(input_ids, self.vocab_start, self.num_embeddings, self.tp, self._lookup)

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint's table (all of it in one process)."""
        if self.tp is None or self.tp.size == 1:
            return tensor
        return tensor.narrow(0, self.vocab_start, self.num_embeddings)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={GGUF_KERNEL_TYPES[self.ggml_type][0]}"


def _target(name: str, fused: FusedMap) -> tuple[str, int, int | None]:
    """Where checkpoint tensor ``name`` goes: (parameter name, row offset, rows or None for all)."""
    for part, (fused_name, offset, size, _) in fused.items():
        if f".{part}." in name:
            return name.replace(part, fused_name), offset, size
    return name, 0, None


def _quantized_targets(
    model: nn.Module, types: Mapping[str, int], fused: FusedMap
) -> dict[str, tuple[list[tuple[int, int, int]], list[str]]]:
    """Parameters every checkpoint part of which is quantized in a type with a kernel: name -> (the parts'
    ``(row offset, rows, ggml type)``, the parts' checkpoint names)."""
    parts: dict[str, list[tuple[str, int, int | None]]] = {}
    for name in types:
        target, offset, size = _target(name, fused)
        parts.setdefault(target, []).append((name, offset, size))
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[list[tuple[int, int, int]], list[str]]] = {}
    for target, found in parts.items():
        param = params.get(target)
        if param is None or param.dim() != 2:
            continue
        kinds = {types[name] for name, _, _ in found}
        if not all(gguf_kernel_takes(kind, param.shape[1]) for kind in kinds):
            continue
        # a row-parallel shard (layers/parallel.py) must start on a block boundary to take whole blocks
        start = getattr(modules.get(target.rpartition(".")[0]), "input_start", 0)
        if start and not all(gguf_kernel_takes(kind, start) for kind in kinds):
            continue
        spans = [(offset, param.shape[0] if size is None else size, types[name]) for name, offset, size in found]
        if sum(rows for _, rows, _ in spans) == param.shape[0]:  # every part of a fused parameter is there
            chosen[target] = (sorted(spans), [name for name, _, _ in found])
    return chosen


def use_gguf_weights(model: nn.Module, types: Mapping[str, int], fused: FusedMap, embedding: str) -> set[str]:
    """Give the layers of ``model`` (on the meta device) GGUF storage for the checkpoint tensors in ``types``.

    ``types``: checkpoint tensor name -> ggml type, for the tensors the
    checkpoint can hand over as stored; those of a type with no kernel here
    stay with the float weights. ``embedding``: the name of the token
    embedding's weight. Returns the checkpoint names whose layers took them
    quantized; the others are to be loaded as float weights.
    """
    modules = dict(model.named_modules())
    kept: set[str] = set()
    for target, (spans, names) in _quantized_targets(model, types, fused).items():
        owner_name = target.rsplit(".", 1)[0]
        owner = modules[owner_name]
        ggml_type = spans[0][2]
        mixed = any(kind != ggml_type for _, _, kind in spans)
        if target == embedding and isinstance(owner, nn.Embedding) and not mixed:
            parent, _, child = owner_name.rpartition(".")
            with torch.device("meta"):
                setattr(modules[parent] if parent else model, child,
                        GGUFEmbedding(owner.num_embeddings, owner.embedding_dim, ggml_type,
                                      getattr(owner, "tp", None), getattr(owner, "vocab_start", 0)))
        elif isinstance(owner, Linear) and target.endswith(".weight"):
            replace_parameter(owner, "weight", None)
            if mixed:
                owner.quant_method = GGUFPartsLinearMethod(spans, owner.in_features)
                shape = [owner.quant_method.num_bytes]  # [bytes]: the parts one after another
            else:
                owner.quant_method = GGUFLinearMethod(ggml_type)
                shape = [owner.out_features, gguf_row_bytes(ggml_type, owner.in_features)]  # [out_features, row bytes]
            owner.register_buffer("qweight", torch.empty(shape, dtype=torch.uint8, device="meta"))
        else:
            continue
        kept.update(names)
    return kept


def interleave_gguf_weights(model: nn.Module) -> int:
    """Interleave the loaded Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K-Q6_K blocks of ``model`` 16 rows at a time, in place;
    returns how many tensors were.

    The same bytes in another order (``kernels/gguf_x16.h``), which the
    kernels multiply with integer dot products on activations rounded to
    int8 per block of 32, as llama.cpp does: 2-3x the file order's speed
    for one row (more for the k-quants). A tensor whose rows are not a multiple of 16 stays in the
    file's order. A table shared by a tied LM head and the embedding is
    interleaved once, and both take the new type; a fused layer of mixed
    types (``GGUFPartsLinearMethod``), part by part.
    """
    users: dict[int, list[nn.Module]] = {}  # qweight storage -> the modules reading it
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.quant_method, GGUFPartsLinearMethod):
            count += module.quant_method.interleave(module)
        elif isinstance(module, GGUFEmbedding) or (
            isinstance(module, Linear) and isinstance(module.quant_method, GGUFLinearMethod)
        ):
            users.setdefault(module.qweight.untyped_storage().data_ptr(), []).append(module)
    for modules in users.values():
        types = {_gguf_type(m) for m in modules}
        qweight, in_features = modules[0].qweight, _gguf_in_features(modules[0])
        if len(types) != 1 or (ggml_type := types.pop()) not in GGUF_INTERLEAVED or qweight.shape[0] % INTERLEAVE_ROWS:
            continue
        torch.ops.pagedllm.gguf_interleave_(qweight, ggml_type, in_features)
        for module in modules:
            if isinstance(module, GGUFEmbedding):
                module.ggml_type = GGUF_INTERLEAVED[ggml_type]
            else:
                module.quant_method = GGUFLinearMethod(GGUF_INTERLEAVED[ggml_type])
        count += 1
    return count


def gguf_types_held(model: nn.Module) -> set[int]:
    """The kernel type numbers of every GGUF tensor ``model`` holds (embedding, linear layers, their parts)."""
    held: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, GGUFEmbedding):
            held.add(module.ggml_type)
        elif isinstance(method, GGUFLinearMethod):
            held.add(method.ggml_type)
        elif isinstance(method, GGUFPartsLinearMethod):
            held.update(t for _, _, t in method.parts)
    return held


def _gguf_type(module: nn.Module) -> int:
    return module.ggml_type if isinstance(module, GGUFEmbedding) else module.quant_method.ggml_type


def _gguf_in_features(module: nn.Module) -> int:
    return module.embedding_dim if isinstance(module, GGUFEmbedding) else module.in_features


def tie_gguf_lm_head(lm_head: Linear, embedding: nn.Module) -> bool:
    """Let a tied LM head multiply by a GGUF embedding's bytes (held once); False when the embedding is not GGUF."""
    if not isinstance(embedding, GGUFEmbedding):
        return False
    lm_head.quant_method = GGUFLinearMethod(embedding.ggml_type)
    replace_parameter(lm_head, "weight", None)
    lm_head.register_buffer("qweight", embedding.qweight)
    return True
