"""Which traced ops are ``pagedllm.StepProgram`` nodes, and with what: read from the ops' schemas.

A traced decode step (``runner/capture/decode_graph.py``) calls ~360 kernels; each
opens its own OpenMP parallel region, and on two cores the team falls
asleep between regions and is woken ~360 times a step. The lowering hands
every run of ops ``native_calls`` knows to one native ``StepProgram``
(``kernels/step/step_program.h``), which runs their kernels back to back in a
single parallel region, the team meeting at a barrier between them:

    traced ops      embedding  index  index  add_rms_norm  packed_linear ... mul ... add_
    runs            [------------ StepProgram.run() -------------]   mul   [-- run() --]

A ``torch.ops.pagedllm`` op is a program node of the same name, its
arguments taken from its schema in order (``kernels/ops.cpp``): tensors,
ints (and bools) and floats each in a list, the op's new result appended to
the tensors. The native side reads them the same way: an op's node builder
takes the schema's arguments as C++ parameters in order, then the result,
registered by one line after the schema and checked against it when the
library loads, and the program unpacks the lists by the builder's parameter
types. So a kernel is described once, by its schema, and neither side names
an op's arguments; the program's ``add`` refuses (ValueError) an op it has
no builder for, or lists of the wrong lengths, and the op stays a Python
call. The few aten ops a decode step moves rows with (the token embedding,
the RoPE table lookup, copies, the residual add) are named here, as nodes
with builders of their own.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# (op name for StepProgram.add, tensors, ints, floats)
NativeCall = tuple[str, list[torch.Tensor | None], list[int], list[float]]

_TENSOR_TYPES = ("Tensor", "Optional[Tensor]")


def _schema_call(op: Any, args: tuple, kwargs: dict, out: torch.Tensor | None) -> NativeCall | None:  # noqa: ANN401
    """A pagedllm op's program node: its schema's arguments by kind, in order; None for an argument of another kind."""
    tensors: list[torch.Tensor | None] = []
    ints: list[int] = []
    floats: list[float] = []
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            return None
        kind = str(arg.type)
        if kind in _TENSOR_TYPES:
            tensors.append(value)
        elif kind in ("int", "bool"):
            ints.append(int(value))
        elif kind == "float":
            floats.append(float(value))
        elif kind == "Optional[float]":  # a limit, None for none (ssd_decode's dt_max)
            floats.append(math.inf if value is None else float(value))
        else:
            return None
    if out is not None:
        tensors.append(out)
    return op._schema.name.split("::")[-1], tensors, ints, floats


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


def _aten_calls(name: str, a: tuple, kwargs: dict, out: torch.Tensor | None) -> list[NativeCall] | None:
    """The program nodes of the row moves a decode step traces between kernels, or None."""
    if name in ("clone.default", "contiguous.default") and len(a) == 1 and out is not None:
        # q.contiguous() of a strided view; clone's memory_format: the copy writes a contiguous tensor
        if kwargs not in ({}, {"memory_format": torch.contiguous_format}):
            return None
        return [("copy_rows", [a[0], out], [], [])]
    if kwargs or (out is None and name != "add_.Tensor"):
        return None
    if name == "cat.default" and isinstance(a[0], (list, tuple)):
        return _cat_calls(list(a[0]), a[1] if len(a) > 1 else 0, out)
    if name == "embedding.default" and len(a) == 2:  # the token embedding: rows of the table
        return [("gather_rows", [a[0], a[1], out], [], [])]
    if name == "index.Tensor" and len(a[1]) == 1 and isinstance(a[1][0], torch.Tensor):  # cos[positions]
        return [("gather_rows", [a[0], a[1][0], out], [], [])]
    if name == "index_select.default" and a[1] == 0:
        return [("gather_rows", [a[0], a[2], out], [], [])]
    if name == "add_.Tensor" and len(a) == 2 and isinstance(a[1], torch.Tensor):  # the residual add
        return [("add_", [a[0], a[1]], [], [])]
    return None


def native_calls(op: Any, args: tuple, kwargs: dict, out: torch.Tensor | None) -> list[NativeCall] | None:  # noqa: ANN401
    """What ``StepProgram.add`` takes to run ``op(*args, **kwargs)`` (its new result ``out``), in turn; None
    where the op is no program node."""
    namespace = getattr(op, "namespace", None)
    if namespace == "pagedllm":
        call = _schema_call(op, args, kwargs, out)
        return None if call is None else [call]
    if namespace == "aten":
        return _aten_calls(f"{op._opname}.{op._overloadname}", args, kwargs, out)
    return None
