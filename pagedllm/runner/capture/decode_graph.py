"""A decode step traced once with torch.fx, symbolic in its rows, and run on static buffers.

A decode step of SmolLM2-135M runs 30 layers of a handful of native
kernels each; run through the ``nn.Module`` tree, the Python between those
calls (module calls, attribute lookups, backend checks, views) costs a
third of a one-sequence step. ``trace`` records what the model's one Python
definition runs as an FX graph (``make_fx(tracing_mode="symbolic")``, on fake
tensors, in about a second): the step's row count and its block-table width
are symbols, so one trace serves every batch size. ``lower`` then walks the
graph once at the most rows and the widest tables it will run:

    FX node                         at lowering               at every step
    ─────────────────────────────   ───────────────────────   ──────────────────────────
    a view (view, slice, getitem)   made: a view of a static  nothing
                                    buffer
    empty / empty_like              a static buffer           nothing
    a kernel with a StepProgram     a node of the current     one StepProgram.run(rows)
    node (``step_program.py``)      native program            per program
    any other op (Gemma's GELU)     a ``PythonCall`` on its   the op on the first rows,
                                    static tensors            copied into its buffer

Every new tensor is a static buffer of the most rows; buffers whose uses do
not overlap share memory, so a graph holds about two layers' activations,
not thirty. A step of ``n`` rows copies its inputs into the leading corner
of the static inputs and runs every program and Python call over the first
``n`` rows.

What a step reads must come through its input tensors: ``trace`` refuses
(``CaptureError``) a function that reads a tensor into Python, and a tensor
the trace made a constant of that is not memory the caller owns (weights,
buffers, the KV cache): it was made in Python from the step and would be
replayed stale. Where the traced code branched on the row count (a linear
method that changes kernels past some rows), the trace's shape guards say
which row counts it holds for (``valid_rows``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pagedllm.runner.capture.step_program import native_calls

_aten = torch.ops.aten
# new tensors of undefined content: a static buffer stands for them, nothing runs
_EMPTY = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default, _aten.new_empty.default}


class CaptureError(ValueError):
    """The function cannot be run from a trace (see the module docstring)."""


def trace(fn: Callable[..., torch.Tensor], example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """``fn`` as an FX graph of aten and pagedllm ops whose input sizes are symbols.

    ``example_inputs`` must have at least two rows (and two of every other
    dimension that varies): a size of 0 or 1 is traced as a constant.
    Raises ``CaptureError`` when ``fn`` cannot be traced.
    """
    try:
        gm = make_fx(fn, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*example_inputs)
    except Exception as e:  # any failure of the trace means: run the model directly
        raise CaptureError(f"the step cannot be traced: {type(e).__name__}: {e}") from e
    outputs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    if isinstance(outputs, (list, tuple)) or not isinstance(outputs.meta.get("val"), torch.Tensor):
        raise CaptureError("the captured function must return one tensor")
    return gm


def _storage(t: torch.Tensor) -> int | tuple[str, int]:
    """What identifies a tensor's memory: its storage's address; a tensor without one (oneDNN's
    opaque weights) is known by the object itself, which whoever owns it keeps alive."""
    if t.layout != torch.strided:
        return ("object", id(t))
    return t.untyped_storage().data_ptr()


def check_constants(gm: fx.GraphModule, owned: Iterable[torch.Tensor]) -> None:
    """Raise ``CaptureError`` for a constant of the trace that is not memory the caller owns."""
    known = {_storage(t) for t in owned}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        t = getattr(gm, node.target)
        if isinstance(t, torch.Tensor) and _storage(t) not in known:
            raise CaptureError(
                f"the step reads a tensor {tuple(t.shape)} that is neither an input nor memory the model owns: "
                "it was made in Python from the step and would be replayed stale"
            )


def input_symbols(gm: fx.GraphModule) -> list[list[Any]]:
    """Per input of the graph, per dimension: its sympy symbol, or its size where the trace fixed it."""
    dims = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            dims.append([d.node.expr if isinstance(d, torch.SymInt) else d for d in node.meta["val"].shape])
    return dims


def valid_rows(gm: fx.GraphModule, rows: Any, bindings: dict, max_rows: int) -> list[int]:  # noqa: ANN401
    """The row counts up to ``max_rows`` every shape guard of the trace holds for (``rows``: the row symbol,
    ``bindings``: the other symbols' values)."""
    val = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]
    shape_env = next((d.node.shape_env for d in val.shape if isinstance(d, torch.SymInt)), None)
    guards = [g.expr for g in shape_env.guards] if shape_env is not None else []
    return [r for r in range(1, max_rows + 1)
            if all(bool(g.xreplace({**bindings, rows: r})) for g in guards)]


class PythonCall:
    """One op with no native node, run from Python over the first rows of its static tensors.

    A tensor argument whose first dimension is ``c`` times the step's rows
    (``c`` = 1: the rows themselves; ``c`` = top_k: a mixture of experts'
    (token, slot) pairs) is cut to ``c * n`` rows for a step of ``n``, as is
    an integer argument that was ``c`` times the rows (``arange(num_pairs)``):
    rows past the step's are never read, so stale values there (a larger
    step's, or a buffer's first contents) cannot reach the result. ``out``:
    its static result (or results, for an op that returns several), whose
    first rows the op's result is copied to where it is over the rows, or whole.
    """

    def __init__(self, op: Any, args: tuple, kwargs: dict, out: Any, rows: Any,  # noqa: ANN401
                 arg_vals: tuple, out_vals: Any) -> None:  # noqa: ANN401
        self.op, self.kwargs = op, kwargs
        self.flat_args, self.spec = tree_flatten(args)
        # per flat argument: 0 (passed as is) or c (a tensor cut to c * n rows, an int replaced by c * n)
        self.row_args = tuple(_arg_factor(v, rows) for v in tree_flatten(arg_vals)[0])
        if len(self.row_args) != len(self.flat_args):
            raise CaptureError(f"{op}: its arguments do not match their traced values")
        outs = out if isinstance(out, (list, tuple)) else (out,)
        vals = out_vals if isinstance(out_vals, (list, tuple)) else (out_vals,)
        self.several = isinstance(out, (list, tuple))
        # per result: its static buffer (None: nothing kept) and the factor of its rows (0: copied whole)
        self.outs = [(o, _row_factor(v.shape[0], rows) if isinstance(v, torch.Tensor) and v.dim() >= 1 else 0)
                     for o, v in zip(outs, vals)]

    def __call__(self, n: int) -> None:
        """Run the op over the first ``n`` rows."""
        flat = [a if not c else (a.narrow(0, 0, c * n) if isinstance(a, torch.Tensor) else c * n)
                for a, c in zip(self.flat_args, self.row_args)]
        result = self.op(*tree_unflatten(flat, self.spec), **self.kwargs)
        for (out, c), r in zip(self.outs, result if self.several else (result,)):
            if out is not None:
                (out.narrow(0, 0, c * n) if c else out).copy_(r)


def _row_factor(dim: Any, rows: Any) -> int:  # noqa: ANN401
    """``c`` where a traced size is ``c`` times the row symbol (a positive integer), else 0."""
    if not isinstance(dim, torch.SymInt):
        return 0
    ratio = dim.node.expr / rows
    return int(ratio) if ratio.is_Integer and ratio > 0 else 0


def _arg_factor(v: Any, rows: Any) -> int:  # noqa: ANN401
    """What ``PythonCall`` cuts of a traced argument: a tensor over ``c`` times the rows, or such an int."""
    if isinstance(v, torch.Tensor):
        return _row_factor(v.shape[0], rows) if v.dim() >= 1 else 0
    return _row_factor(v, rows)


def num_programs(runs: list[Callable[[int], None]]) -> int:
    """How many of ``runs`` are native programs (the others are ``PythonCall``s)."""
    return sum(1 for run in runs if not isinstance(run, PythonCall))


class DecodeGraph:
    """A traced step lowered to runs over static buffers of ``max(rows)`` rows; see the module docstring.

    ``runs`` is what a step calls, in order, each with the rows to run:
    ``StepProgram.run`` of each native program and a ``PythonCall`` per op
    between them. ``rows``: the row counts the trace holds for.
    """

    def __init__(self, inputs: list[torch.Tensor], runs: list[Callable[[int], None]], result: torch.Tensor,
                 rows: list[int], num_buffers: int) -> None:
        self.inputs = inputs
        self.runs = runs
        self.result = result
        self.rows = rows
        self.num_buffers = num_buffers  # static buffers after sharing

    def replay(self, inputs: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
        """The step's result ``[rows, ...]`` for ``inputs``, each copied into the leading corner of its static
        input; a view of a static buffer, overwritten by the next replay. ValueError for inputs that do not fit.

        What lies outside the corner is left as it was: the inputs must say
        what is read (as sequence lengths bound the block-table columns a
        decode reads).
        """
        if rows not in self.rows or len(inputs) != len(self.inputs) or any(
            t.dim() != s.dim() or t.dtype != s.dtype or t.shape[0] != rows
            or any(a > b for a, b in zip(t.shape, s.shape))
            for t, s in zip(inputs, self.inputs)
        ):
            raise ValueError("a decode graph was replayed with inputs that do not fit the traced ones")
        for static, t in zip(self.inputs, inputs):
            static[tuple(slice(0, n) for n in t.shape)].copy_(t)
        for run in self.runs:
            run(rows)
        return self.result.narrow(0, 0, rows)


def lower(gm: fx.GraphModule, inputs: list[torch.Tensor], rows: Any, bindings: dict,  # noqa: ANN401
          valid: list[int], native: bool) -> DecodeGraph:
    """``gm`` as runs over static buffers: ``inputs`` are the static inputs (of the most rows, ``bindings``
    the symbols' values at those sizes, ``rows`` the row symbol), ``native``: lower to StepPrograms."""
    return _Lowering(gm, inputs, rows, bindings, native).graph(valid)


class _Lowering:
    """One walk of the graph at the static sizes: views made, buffers assigned, kernels grouped into programs."""

    def __init__(self, gm: fx.GraphModule, inputs: list[torch.Tensor], rows: Any, bindings: dict,  # noqa: ANN401
                 native: bool) -> None:
        self.gm, self.inputs, self.rows, self.bindings, self.native = gm, inputs, rows, bindings, native
        self.nodes = list(gm.graph.nodes)
        self.env: dict[fx.Node, Any] = {}
        self.root: dict[fx.Node, fx.Node] = {}  # node -> the node that made the buffer it is (a view of)
        self.last: dict[fx.Node, int] = {}  # buffer node -> the last node reading it (or a view of it)
        self.free: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> buffers free for reuse
        self.owner: dict[fx.Node, torch.Tensor] = {}  # buffer node -> its buffer
        self.num_buffers = 0
        self.runs: list[Callable[[int], None]] = []
        self.program: Any = None  # torch.classes.pagedllm.StepProgram being filled

    def graph(self, valid: list[int]) -> DecodeGraph:
        self._lifetimes()
        result, num_inputs = None, 0
        for i, node in enumerate(self.nodes):
            if node.op == "placeholder":
                self.env[node] = self.inputs[num_inputs]
                num_inputs += 1
            elif node.op == "get_attr":
                self.env[node] = getattr(self.gm, node.target)
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                result = self.env[node.args[0]]
            self._release(i)
        self._close_program()
        return DecodeGraph(self.inputs, self.runs, result, valid, self.num_buffers)

    def _lifetimes(self) -> None:
        """Which buffer each node is (a view of), and the last node that reads each buffer."""
        index = {n: i for i, n in enumerate(self.nodes)}
        for node in self.nodes:
            if node.op == "call_function" and _aliases(node):
                base = next((a for a in node.all_input_nodes if a in self.root), None)
                self.root[node] = self.root[base] if base is not None else node
            else:
                self.root[node] = node
        for node in self.nodes:
            for user in node.users:
                end = len(self.nodes) if user.op == "output" else index[user]
                r = self.root[node]
                self.last[r] = max(self.last.get(r, 0), end)

    def _release(self, i: int) -> None:
        """Return the buffers whose last reader was node ``i`` to the pool."""
        for node, owned in list(self.owner.items()):
            if self.last.get(node, 0) <= i:
                for buffer in owned if isinstance(owned, tuple) else (owned,):
                    self.free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)
                del self.owner[node]

    def _buffers(self, node: fx.Node, vals: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Static buffers for each of ``node``'s new results (``vals``, as traced), released together."""
        outs = []
        for val in vals:
            outs.append(self._buffer(node, val))
            del self.owner[node]
        self.owner[node] = tuple(outs)
        return tuple(outs)

    def _buffer(self, node: fx.Node, val: torch.Tensor | None = None) -> torch.Tensor:
        """A static buffer for ``node``'s new result (``val``: which one, where it has several): a free one of
        its shape, or a new one."""
        val = node.meta["val"] if val is None else val
        shape = tuple(int(d.node.expr.xreplace(self.bindings)) if isinstance(d, torch.SymInt) else d
                      for d in val.shape)
        pool = self.free.get((shape, val.dtype))
        if pool:
            buffer = pool.pop()
        else:
            buffer = torch.empty(shape, dtype=val.dtype)  # [*node's shape at the most rows]
            self.num_buffers += 1
        self.owner[node] = buffer
        return buffer

    def _call(self, node: fx.Node) -> None:
        op = node.target
        args, kwargs = tree_map(self._value, (node.args, node.kwargs))
        if op in _EMPTY:
            self.env[node] = self._buffer(node)
            return
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):  # a size: its value here
            self.env[node] = op(*args, **kwargs)
            return
        if _aliases(node) and not _writes(op):  # a view: made once, of the static buffers
            self.env[node] = op(*args, **kwargs)
            return
        if not node.users and not _writes(op):
            return  # a result no one reads
        if isinstance(val, (list, tuple)) and not _aliases(node):  # several new tensors (topk, sort): Python
            if not all(isinstance(v, torch.Tensor) for v in val):
                raise CaptureError(f"{op} returns several values that are not all tensors")
            outs = self._buffers(node, val)
            self.env[node] = outs
            self._close_program()
            self.runs.append(self._python_call(node, op, args, kwargs, outs))
            return
        returns_new = isinstance(val, torch.Tensor) and not _aliases(node)
        out = self._buffer(node) if returns_new else None
        self.env[node] = out if returns_new else (args[0] if _aliases(node) else None)
        calls = native_calls(op, args, kwargs, out) if self.native else None
        if calls is not None and self._add_to_program(op, calls):
            return
        self._close_program()
        self.runs.append(self._python_call(node, op, args, kwargs, out))

    def _value(self, a: Any) -> Any:  # noqa: ANN401
        """A node argument at the static sizes: the node's value (a size node's: its value there)."""
        if isinstance(a, fx.Node):
            return self.env[a]
        return a

    def _python_call(self, node: fx.Node, op: Any, args: tuple, kwargs: dict,  # noqa: ANN401
                     out: torch.Tensor | tuple[torch.Tensor, ...] | None) -> PythonCall:
        if any(isinstance(v, torch.Tensor) for v in tree_flatten(kwargs)[0]):
            raise CaptureError(f"{op} takes tensor keywords, which a step does not cut to its rows")
        traced = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, node.args)
        return PythonCall(op, args, kwargs, out, self.rows, traced, node.meta.get("val"))

    def _add_to_program(self, op: Any, calls: list) -> bool:  # noqa: ANN401
        """Add ``calls`` to the current program; False when it refuses one (the op stays a Python call)."""
        if self.program is None:
            self.program = torch.classes.pagedllm.StepProgram(self.inputs[0].shape[0])
        added = self.program.num_nodes()
        try:
            for call in calls:
                self.program.add(*call)
        except (ValueError, RuntimeError):
            if self.program.num_nodes() != added:  # part of a node is in: the program cannot be rolled back
                raise CaptureError(f"{op} was lowered in part") from None
            return False
        return True

    def _close_program(self) -> None:
        if self.program is not None and self.program.num_nodes() > 0:
            self.runs.append(self.program.run)
        self.program = None


def _writes(op: Any) -> bool:  # noqa: ANN401 (an OpOverload)
    """Whether the op's schema marks an argument as written in place."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _aliases(node: fx.Node) -> bool:
    """Whether the node's result is (a view of) one of its arguments: a view, ``getitem`` of a split, ``add_``."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)
