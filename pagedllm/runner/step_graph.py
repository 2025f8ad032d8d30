"""A forward pass recorded once, op by op, and replayed on static buffers: a CPU "CUDA graph".

A decode step of SmolLM2-135M runs 30 layers of a handful of native
kernels each; run through the ``nn.Module`` tree, the Python between those
calls (module calls, attribute lookups, backend checks, views) costs a
third of a one-sequence step. ``StepGraph`` records what the model's one
Python definition runs and replays only the kernels, as CUDA graphs do on a
GPU:

    capture (once per input shape)              replay (every later step)
    ──────────────────────────────              ─────────────────────────
    fn(*static_inputs) under a                  copy the step's inputs into
    TorchDispatchMode that sees every           the static inputs, then for
    aten and pagedllm op, with real             each kept op: op(*args) on
    tensors (a real step: its result            the same static tensors,
    is used)                                    fresh results copied into
                                                the tensors the next ops read

Per recorded op:

- a view (its result shares memory with an argument) is dropped: the view
  made at capture stays a view of the same static buffer;
- ``empty`` / ``empty_like`` are dropped: their buffer is static and
  whatever reads it wrote it first;
- an op that writes an argument in place (``add_``, ``write_kv``) is kept
  as recorded; an op with a new result is kept and its result copied into
  the static tensor that stood for it at capture.

Every new tensor of the capture is a static buffer; buffers whose uses do
not overlap share memory (one pool per shape), so a graph holds about two
layers' activations, not thirty.

What may be replayed is what depends on the step through the input tensors
only: every non-tensor argument (shapes, slice bounds, eps) is kept as it
was. So a graph is made per input shape, and a caller must only capture
functions that take nothing else from the step. The capture refuses, with
``CaptureError``, an op that reads a tensor into Python (``.item()``), and a
tensor argument that is neither an input, an op's result, nor memory the
caller lists as owned (weights, buffers, the KV cache): it was made in
Python from the step and would be replayed stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_aten = torch.ops.aten
# ops that hand a tensor's values to Python: what they return shapes what Python does next
_UNCAPTURABLE = {_aten._local_scalar_dense.default, _aten.item.default, _aten.nonzero.default}
# new tensors of undefined content: a static buffer stands for them
_EMPTY = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
          _aten.new_empty.default}


class CaptureError(ValueError):
    """The function cannot be replayed from a record (see the module docstring)."""


class _Recorder(TorchDispatchMode):
    """Runs every op as usual and keeps the op, its arguments and its result."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in _UNCAPTURABLE:
            raise CaptureError(f"the function reads a tensor into Python ({func}); it cannot be replayed")
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def _storage(t: torch.Tensor) -> int | tuple[str, int]:
    """What identifies a tensor's memory: its storage's address; a tensor without one (oneDNN's
    opaque weights) is known by the object itself, which whoever owns it keeps alive."""
    if t.layout != torch.strided:
        return ("object", id(t))
    return t.untyped_storage().data_ptr()


def _writes(func: Any) -> bool:  # noqa: ANN401 (an OpOverload)
    """Whether the op's schema marks an argument as written in place."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


@dataclass(frozen=True)
class Node:
    """One kept op: ``op(*args, **kwargs)``, its new result copied to ``copy_to`` (or ``copies``, per flat result).

    ``overload`` is the op as recorded (a ``torch._ops.OpOverload``), for
    whoever lowers nodes to native calls (``runner/step_program.py``);
    ``op`` is its raw callable, cheaper to call.
    """

    overload: Any
    op: Callable[..., Any]
    args: tuple
    kwargs: dict | None
    copy_to: torch.Tensor | None  # one result: the static tensor it goes to
    copies: tuple[torch.Tensor | None, ...] | None  # several results: each one's static tensor (None: none)

    def __call__(self, rows: int | None = None) -> None:
        """Run the op on its static tensors and copy its new result(s) where the next ops read them.

        ``rows`` is ignored: a recorded op runs over all of its rows (see ``StepGraph.replay``).
        """
        out = self.op(*self.args) if self.kwargs is None else self.op(*self.args, **self.kwargs)
        if self.copy_to is not None:
            self.copy_to.copy_(out)
        elif self.copies is not None:
            for static, value in zip(self.copies, tree_flatten(out)[0]):
                if static is not None:
                    static.copy_(value)


class StepGraph:
    """A recorded function of a few input tensors, replayed on its static buffers.

    ``StepGraph.capture`` records it; ``replay(inputs)`` copies ``inputs``
    into the static inputs and reruns the kept ops. The tensor it returns
    is a static buffer, overwritten by the next replay.

    ``runs`` is what a replay calls, in order, each with the rows to run:
    one per node as recorded; ``group`` lets a caller replace runs of nodes
    by one call that does their work (``runner/step_program.py``: native
    programs, which can run fewer rows than they were recorded with).
    """

    def __init__(self, inputs: list[torch.Tensor], nodes: list[Node], result: torch.Tensor,
                 num_recorded: int, num_buffers: int) -> None:
        self.inputs = inputs
        self.nodes = nodes
        self.result = result
        self.num_recorded = num_recorded  # ops seen at capture
        self.num_buffers = num_buffers  # static buffers after sharing
        self.runs: list[Callable[[int], None]] = list(nodes)

    @property
    def num_rows(self) -> int:
        """Rows (the first dimension) of the first input: what a replay runs unless told fewer."""
        return self.inputs[0].shape[0]

    def group(self, lower: Callable[[list[Node]], list[Callable[[int], None]]]) -> None:
        """Replay ``lower(nodes)`` instead of the nodes one by one: calls that do the nodes' work, in order."""
        self.runs = lower(self.nodes)

    @classmethod
    def capture(
        cls, fn: Callable[..., torch.Tensor], example_inputs: Sequence[torch.Tensor], owned: Iterable[torch.Tensor]
    ) -> tuple[StepGraph, torch.Tensor]:
        """Run ``fn`` once on static copies of ``example_inputs``, recording it.

        ``owned``: tensors whose memory the graph may read as it is (weights,
        buffers, KV caches). Returns the graph and ``fn``'s result for these
        inputs (a static buffer). Raises ``CaptureError`` when ``fn`` cannot
        be replayed.
        """
        inputs = [t.clone() for t in example_inputs]
        recorder = _Recorder()
        with recorder:
            result = fn(*inputs)
        if not isinstance(result, torch.Tensor):
            raise CaptureError("the captured function must return one tensor")
        planner = _Planner(inputs, {_storage(t) for t in owned})
        graph = planner.plan(recorder.calls, result)
        if graph.result is not result:  # the result moved to a shared buffer: it holds this step's value too
            graph.result.copy_(result)
        return graph, graph.result

    def replay(self, inputs: Sequence[torch.Tensor], rows: int | None = None) -> torch.Tensor:
        """The function's result for ``inputs``, of the capture's shapes and dtypes (ValueError otherwise).

        With ``rows``, for a graph whose runs are all native programs (which
        cut every op to its first rows): each input may be smaller than the
        capture's in any dimension, and is copied into the leading corner of
        its static input; the programs run the first ``rows`` rows, and so
        does the result. What lies outside the corner is left as it was: the
        caller's inputs must say what is read (as sequence lengths bound the
        block-table columns a decode reads).
        """
        if rows is None:
            if len(inputs) != len(self.inputs) or any(
                t.shape != s.shape or t.dtype != s.dtype for t, s in zip(inputs, self.inputs)
            ):
                raise ValueError("a step graph was replayed with inputs of other shapes than it was captured with")
            for static, t in zip(self.inputs, inputs):
                static.copy_(t)
            rows = self.num_rows
        else:
            self._copy_corners(inputs, rows)
        for run in self.runs:
            run(rows)
        return self.result if rows == self.num_rows else self.result[:rows]

    def _copy_corners(self, inputs: Sequence[torch.Tensor], rows: int) -> None:
        """Copy each input into the leading corner of its static input (see ``replay``); ValueError if it cannot."""
        if len(inputs) != len(self.inputs) or any(
            t.dim() != s.dim() or t.dtype != s.dtype or t.shape[0] != rows
            or any(a > b for a, b in zip(t.shape, s.shape))
            for t, s in zip(inputs, self.inputs)
        ):
            raise ValueError("a step graph was replayed with inputs that do not fit the captured ones")
        if any(isinstance(run, Node) for run in self.runs) and rows != self.num_rows:
            raise ValueError("only a graph of native programs replays fewer rows than it was captured with")
        for static, t in zip(self.inputs, inputs):
            static[tuple(slice(0, n) for n in t.shape)].copy_(t)


class _Planner:
    """Turns a record into kept ops over shared static buffers (see the module docstring)."""

    def __init__(self, inputs: list[torch.Tensor], owned: set[int]) -> None:
        self.inputs = inputs
        self.known = owned | {_storage(t) for t in inputs}  # memory that is not the record's to plan
        self.produced: dict[Any, torch.Tensor] = {}  # storage -> the new tensor it was made for
        self.first: dict[Any, int] = {}  # storage -> the op that made it
        self.last: dict[Any, int] = {}  # storage -> the last op that touched it

    def _check_args(self, i: int, func: Any, tensors: list[torch.Tensor]) -> None:  # noqa: ANN401
        for t in tensors:
            s = _storage(t)
            if s in self.produced:
                self.last[s] = i
            elif s not in self.known:
                raise CaptureError(
                    f"{func} reads a tensor {tuple(t.shape)} that is neither an input, an op's result nor "
                    "memory the model owns: it was made in Python from the step and would be replayed stale"
                )

    def plan(self, calls: list, result: torch.Tensor) -> StepGraph:
        kept: list[tuple[Any, tuple, dict, list[torch.Tensor | None]]] = []
        for i, (func, args, kwargs, out) in enumerate(calls):
            arg_tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            self._check_args(i, func, arg_tensors)
            flat_out = tree_flatten(out)[0]
            fresh: list[torch.Tensor | None] = []
            for o in flat_out:
                new = isinstance(o, torch.Tensor) and _storage(o) not in self.known and _storage(o) not in self.produced
                if new:
                    self.produced[_storage(o)] = o
                    self.first[_storage(o)] = self.last[_storage(o)] = i
                elif isinstance(o, torch.Tensor) and _storage(o) in self.produced:
                    self.last[_storage(o)] = i
                fresh.append(o if new else None)
            if func in _EMPTY or not (_writes(func) or any(f is not None for f in fresh)):
                continue  # a view, an alias or an empty buffer: nothing to run
            kept.append((func, args, kwargs, fresh))
        if _storage(result) not in self.produced:
            raise CaptureError("the captured function returned a tensor no recorded op made")
        self.last[_storage(result)] = len(calls)  # read after the replay
        remap = self._share_buffers()
        nodes = [self._node(func, args, kwargs, fresh, remap) for func, args, kwargs, fresh in kept]
        num_buffers = len({_storage(t) for t in remap.values()}) + len(self.produced) - len(remap)
        return StepGraph(self.inputs, nodes, self._mapped(result, remap), len(calls), num_buffers)

    def _share_buffers(self) -> dict[int, torch.Tensor]:
        """New buffers for the record's storages, shared where lifetimes do not overlap: storage -> buffer."""
        free: dict[tuple, list[tuple[int, torch.Tensor]]] = {}  # geometry -> (free from op, buffer)
        remap: dict[int, torch.Tensor] = {}
        for s in sorted(self.produced, key=lambda s: self.first[s]):
            root = self.produced[s]
            # only a dense tensor that is its whole storage, from its start, can move to another buffer
            if root.layout != torch.strided or not root.is_contiguous() or root.storage_offset() != 0:
                continue
            if root.untyped_storage().nbytes() != root.numel() * root.element_size():
                continue
            key = (tuple(root.shape), root.dtype)
            pool = free.setdefault(key, [])
            reuse = next((j for j, (free_at, _) in enumerate(pool) if free_at < self.first[s]), None)
            buffer = pool.pop(reuse)[1] if reuse is not None else torch.empty_like(root)
            remap[s] = buffer
            pool.append((self.last[s], buffer))
        return remap

    @staticmethod
    def _mapped(t: Any, remap: dict[int, torch.Tensor]) -> Any:  # noqa: ANN401
        """``t`` as a view of the buffer that replaces its storage (``t`` itself when none does)."""
        if not isinstance(t, torch.Tensor) or _storage(t) not in remap:
            return t
        buffer = remap[_storage(t)]
        if t.dtype != buffer.dtype:
            raise CaptureError(f"a view of another dtype ({t.dtype} of {buffer.dtype}) cannot be replayed")
        return buffer.as_strided(t.shape, t.stride(), t.storage_offset())

    def _node(self, func: Any, args: tuple, kwargs: dict, fresh: list, remap: dict) -> Node:  # noqa: ANN401
        """The kept op with every tensor it touches moved to its static buffer."""

        def m(t: Any) -> Any:  # noqa: ANN401
            return self._mapped(t, remap)

        targets = tuple(None if f is None else m(f) for f in fresh)
        single = len(targets) == 1
        return Node(
            func, func._op, tree_map(m, args), tree_map(m, kwargs) if kwargs else None,
            targets[0] if single else None, None if single or not any(t is not None for t in targets) else targets,
        )
