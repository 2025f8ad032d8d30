"""Recorded decode steps run natively: a ``StepGraph``'s nodes lowered to ``pagedllm.StepProgram`` calls.

A replayed ``StepGraph`` (``runner/step_graph.py``) still calls each of its
~360 kernels from Python, and each kernel opens its own OpenMP parallel
region: on two cores the team falls asleep between regions and is woken
~360 times a step. ``lower_to_programs`` hands every run of nodes it knows
to one native ``StepProgram`` (``kernels/step_program.h``), which runs their
kernels back to back in a single parallel region, the team meeting at a
barrier between them:

    recorded nodes     embedding  index  index  add_rms_norm  packed_linear ... mul ... add_
    replay runs        [------------ StepProgram.run() -------------]   mul   [-- run() --]

A node with no native counterpart (``torch.mul`` in Gemma's embedding
scale, say) stays a Python call between two programs. The programs call the
same team functions the eager ops do, on the same static tensors, so a
step computes exactly what the model's forward computes: nothing of the
model is written here, only which recorded op is which kernel call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.runner.step_graph import Node

logger = logging.getLogger(__name__)

# (op name for StepProgram.add, tensors, ints, floats)
NativeCall = tuple[str, list[torch.Tensor | None], list[int], list[float]]


def _pagedllm_call(name: str, a: tuple, kwargs: dict, out: torch.Tensor | None) -> NativeCall | None:
    """The StepProgram call of a recorded ``torch.ops.pagedllm`` op, or None."""
    if name == "add_rms_norm" and out is not None:
        x, delta, weight, eps = a
        return "add_rms_norm", [x, delta, weight, out], [], [float(eps)]
    if name == "qk_norm_rope":
        x, nq, nkv, head_dim, cos, sin, q_norm, k_norm, eps = a
        return "qk_norm_rope", [x, cos, sin, q_norm, k_norm], [nq, nkv, head_dim], [float(eps)]
    if name == "silu_mul" and out is not None:
        return "silu_mul", [a[0], out], [], []
    if name in ("packed_linear", "packed_linear_bf16") and out is not None:
        x, packed, bias, out_features = a
        return name, [x, packed, bias, out], [out_features], []
    if name == "gguf_linear" and out is not None:
        x, weight, ggml_type, in_features, bias = a
        return "gguf_linear", [x, weight, bias, out], [ggml_type, in_features], []
    if name == "gguf_embedding" and out is not None:
        table, ggml_type, row_len, index = a
        return "gguf_embedding", [table, index, out], [ggml_type, row_len], []
    if name == "quantized_linear" and out is not None:
        x, weight, bits, group_size, in_features, bias, *rest = a
        interleaved = kwargs.get("interleaved", rest[0] if rest else False)
        return "quantized_linear", [x, weight, bias, out], [bits, group_size, in_features, int(interleaved)], []
    if name == "quantized_embedding" and out is not None:
        table, bits, group_size, row_len, index, *rest = a
        interleaved = kwargs.get("interleaved", rest[0] if rest else False)
        return "quantized_embedding", [table, index, out], [bits, group_size, row_len, int(interleaved)], []
    if name == "write_kv":
        return "write_kv", list(a), [], []
    if name == "paged_decode":
        q, k_cache, v_cache, tables, seq_lens, scale, result, *rest = a
        window = kwargs.get("window", rest[0] if rest else 0)
        return "paged_decode", [q, k_cache, v_cache, tables, seq_lens, result], [window], [float(scale)]
    return None


def _cat_calls(parts: list, dim: int, out: torch.Tensor) -> list[NativeCall] | None:
    """``torch.cat(parts, dim)`` along the last dimension (a fused layer's parts, each computed apart: a GGUF
    q/k/v of mixed types) as one row copy per part into its columns of ``out``, or None."""
    if not all(isinstance(p, torch.Tensor) and p.dim() == out.dim() for p in parts) or dim % out.dim() != out.dim() - 1:
        return None
    calls: list[NativeCall] = []
    offset = 0
    for part in parts:
        calls.append(("copy_rows", [part, out.narrow(-1, offset, part.shape[-1])], [], []))
        offset += part.shape[-1]
    return calls if offset == out.shape[-1] else None


def _aten_call(name: str, a: tuple, out: torch.Tensor | None) -> NativeCall | list[NativeCall] | None:
    """The StepProgram call(s) of the row moves a decode step records between kernels, or None."""
    if out is None and name != "add_.Tensor":
        return None
    if name == "cat.default" and isinstance(a[0], (list, tuple)):
        return _cat_calls(list(a[0]), a[1] if len(a) > 1 else 0, out)
    if name == "embedding.default" and len(a) == 2:  # the token embedding: rows of the table
        return "gather_rows", [a[0], a[1], out], [], []
    if name == "index.Tensor" and len(a[1]) == 1 and isinstance(a[1][0], torch.Tensor):  # cos[positions]
        return "gather_rows", [a[0], a[1][0], out], [], []
    if name == "index_select.default" and a[1] == 0:
        return "gather_rows", [a[0], a[2], out], [], []
    if name in ("clone.default", "contiguous.default") and len(a) == 1:  # q.contiguous() of a strided view
        return "copy_rows", [a[0], out], [], []
    if name == "add_.Tensor" and len(a) == 2 and isinstance(a[1], torch.Tensor):  # the residual add
        return "add_", [a[0], a[1]], [], []
    return None


def native_call(node: Node) -> NativeCall | list[NativeCall] | None:
    """What ``StepProgram.add`` takes to run ``node`` (one call, or several in turn), when the program has node
    kinds for its op."""
    overload = node.overload
    namespace = getattr(overload, "namespace", None)
    kwargs = node.kwargs or {}
    if namespace == "pagedllm":
        if set(kwargs) - {"window"}:
            return None
        return _pagedllm_call(overload._opname, node.args, kwargs, node.copy_to)
    # clone's memory_format: the copy node writes a contiguous tensor, what contiguous() asks for
    if namespace == "aten" and kwargs in ({}, {"memory_format": torch.contiguous_format}):
        name = f"{overload._opname}.{overload._overloadname}"
        if kwargs and name != "clone.default":
            return None
        return _aten_call(name, node.args, node.copy_to)
    return None


def lower_to_programs(nodes: list[Node], rows: int) -> list[Callable[[int], None]]:
    """``nodes`` as replay calls: each run of natively known nodes one ``StepProgram.run``, the others as they are.

    ``rows``: the tokens the nodes were recorded with; every node of a
    program must be over them (so that it runs fewer, when asked). A node
    whose tensors a program cannot take (the checks of ``StepProgram.add``
    raise ValueError) stays a Python call.
    """
    runs: list[Callable[[int], None]] = []
    program: Any = None  # torch.classes.pagedllm.StepProgram being filled
    for node in nodes:
        call = native_call(node)
        if call is not None:
            if program is None:
                program = torch.classes.pagedllm.StepProgram(rows)
            try:
                # a node of several calls that fails part way runs from Python after the calls added:
                # they write what the node then writes whole, so the step is the same
                for one in call if isinstance(call, list) else [call]:
                    program.add(*one)
                continue
            except (ValueError, RuntimeError) as e:
                logger.debug("%s stays a Python call: %s", node.overload, e)
        if program is not None and program.num_nodes() > 0:
            runs.append(program.run)
        program = None
        runs.append(node)
    if program is not None and program.num_nodes() > 0:
        runs.append(program.run)
    return runs


def num_programs(runs: list[Callable[[int], None]]) -> int:
    """How many of ``runs`` are native programs (the others are recorded nodes run from Python)."""
    return sum(1 for run in runs if not isinstance(run, Node))
