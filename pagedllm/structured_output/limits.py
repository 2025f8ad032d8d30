"""Limits on structured-output constraints, and the cheap checks that refuse hostile ones before any compile.

A grammar compile costs time and memory that grow with the constraint, some
of it faster than linearly (xgrammar's JSON schema converter builds a rule
per optional property *suffix*: 1,000 optional properties took ~20 s and
5,000 never finished here). ``GrammarLimits`` bounds both ends:

- structural limits, checked in microseconds on the request's own data
  (``check_constraint``, ``check_schema``): the constraint's size in bytes,
  its enum/const/choice entries, its nesting depth and its object properties;
- compile limits, enforced by running the compile where it can be killed
  (``compile_workers.py``): wall time, memory, and how many compiles run at once;
- the compiled-grammar cache's size in bytes (``structured_output.py``).

This module imports neither torch nor xgrammar: ``EngineConfig`` holds a
``GrammarLimits``, and the engine package must stay torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.config_record import PositiveFloat, PositiveInt, config_record

# keywords whose values are data (a JSON value), not schemas
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map property names to schemas
_PROPERTY_MAPS = frozenset({"properties", "patternProperties"})


class GrammarLimitError(ValueError):
    """A constraint over one of the ``GrammarLimits`` (a 400 on the server, a ValueError offline)."""


@config_record(prefix="grammar_limits.")
class GrammarLimits:
    """What one structured-output constraint may cost; each field has an engine flag of the same name.

    Defaults pass real schemas (OpenAI's strict structured outputs allow 10
    nesting levels, 1,000 enum values, 5,000 properties and 120,000
    characters of names and values) while keeping a compile to seconds on
    a small CPU; see docs/server-limits.md.

    Attributes:
        max_bytes: the constraint's text (a schema as JSON, a regex, a
            grammar, the choices as a JSON list), UTF-8 bytes.
        max_num_entries: enum values, ``const``s and ``choice`` items, all
            counted together over the whole constraint.
        max_depth: nesting of JSON objects and arrays in a schema (a
            property of an object inside an object is depth 4: schema,
            ``properties``, schema, ``properties``).
        max_num_properties: object properties over the whole schema
            (``properties`` and ``patternProperties`` entries).
        compile_timeout_s: longest a compile may run (seconds); the
            compile is killed past it.
        compile_memory_bytes: the most memory a compile may allocate; the
            compile is killed (its process runs under this address-space limit) past it.
        max_num_compiles: compiles running at once (each in its own worker
            process); more wait for a free one.
        cache_bytes: the compiled grammars kept for reuse, in bytes (xgrammar's
            ``memory_size_bytes``); a grammar larger than this is refused.
    """

    max_bytes: PositiveInt = 128 * 1024
    max_num_entries: PositiveInt = 2000
    max_depth: PositiveInt = 32
    max_num_properties: PositiveInt = 500
    compile_timeout_s: PositiveFloat = 15.0
    compile_memory_bytes: PositiveInt = 1 << 30
    max_num_compiles: PositiveInt = 1
    cache_bytes: PositiveInt = 256 << 20

    def refuse(self, what: str, amount: int | float, limit: str, unit: str = "") -> GrammarLimitError:
        """The error for ``what`` measuring ``amount`` over the limit ``limit`` (a field name)."""
        flag = "--grammar-" + limit.replace("_", "-")
        return GrammarLimitError(
            f"{what} has {amount}{unit}, more than the limit of {getattr(self, limit)}{unit} "
            f"(server flag {flag}, GrammarLimits.{limit})"
        )


@dataclass
class _Counts:
    """What a walk over a schema counted."""

    depth: int = 0
    num_entries: int = 0
    num_properties: int = 0


def _count(schema: Any) -> _Counts:  # noqa: ANN401 - any JSON value
    """Depth, enum/const entries and properties of a parsed schema, walked without recursion."""
    counts = _Counts()
    stack: list[tuple[Any, int, bool]] = [(schema, 1, False)]  # node, its depth, whether it is data
    while stack:
        node, depth, is_data = stack.pop()
        if isinstance(node, dict):
            counts.depth = max(counts.depth, depth)
            for key, value in node.items():
                child_is_data = is_data or key in _DATA_KEYWORDS
                if not is_data:
                    if key == "enum" and isinstance(value, list):
                        counts.num_entries += len(value)
                    elif key == "const":
                        counts.num_entries += 1
                    elif key in _PROPERTY_MAPS and isinstance(value, dict):
                        counts.num_properties += len(value)
                if isinstance(value, (dict, list)):
                    stack.append((value, depth + 1, child_is_data))
        elif isinstance(node, list):
            counts.depth = max(counts.depth, depth)
            stack.extend((item, depth + 1, is_data) for item in node if isinstance(item, (dict, list)))
    return counts


def check_schema(schema: Any, where: str, limits: GrammarLimits, text: str | None = None) -> None:  # noqa: ANN401
    """GrammarLimitError naming ``where`` when a parsed JSON schema is over a structural limit.

    ``text``: the schema as JSON, when the caller has it already (else it is dumped here).
    """
    num_bytes = len((text if text is not None else json.dumps(schema, ensure_ascii=False)).encode())
    if num_bytes > limits.max_bytes:
        raise limits.refuse(where, num_bytes, "max_bytes", " bytes")
    counts = _count(schema)
    if counts.depth > limits.max_depth:
        raise limits.refuse(where, counts.depth, "max_depth", " levels of nesting")
    if counts.num_entries > limits.max_num_entries:
        raise limits.refuse(where, counts.num_entries, "max_num_entries", " enum/const entries")
    if counts.num_properties > limits.max_num_properties:
        raise limits.refuse(where, counts.num_properties, "max_num_properties", " object properties")


def check_constraint(kind: str, value: Any, text: str, limits: GrammarLimits) -> None:  # noqa: ANN401
    """GrammarLimitError when a constraint (``StructuredOutputsParams``' kind, value, key text) is over a limit."""
    where = f"structured_outputs.{kind}"
    if kind == "json":
        check_schema(value, where, limits, text)
        return
    num_bytes = len(text.encode())
    if num_bytes > limits.max_bytes:
        raise limits.refuse(where, num_bytes, "max_bytes", " bytes")
    if kind == "choice" and len(value) > limits.max_num_entries:
        raise limits.refuse(where, len(value), "max_num_entries", " entries")
