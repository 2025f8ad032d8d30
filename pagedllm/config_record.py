"""How every configuration record of pagedllm is declared: a frozen pydantic dataclass whose fields carry their
constraints, whose errors read as one line naming the field, and whose docstring documents each field.

``@config_record`` turns a class into such a record. Its fields say what they take in their types:
``PositiveInt``, ``NonNegativeInt``, ``PositiveFloat``, ``NonEmptyStr``, ``Literal[...]`` choices, or
``Annotated[..., Field(...)]`` for any other bound; a field validator or a ``model_validator`` checks what
fields say about each other. Validation is strict: an integer field takes no bool, float or string, so a
typo'd value is an error, never a silent coercion.

Errors stay ValueErrors (``ConfigError``) with a readable message such as
``block_size must be a positive integer, got 0`` instead of pydantic's multi-line report. The command line
(``entrypoints/arg_fields.py``) reads each field's help from the ``Attributes:`` section of the class docstring
(``field_docs``), so a field is documented once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, get_type_hints

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

T = TypeVar("T")

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class ConfigError(ValueError):
    """A configuration record refused a value; the message names the field (``grammar_limits.max_bytes ...``)."""


def positive_multiple_of(step: int, optional: bool = False) -> BeforeValidator:
    """A field validator: an int (never a bool) that is a positive multiple of ``step`` (or None if ``optional``)."""

    def check(value: object) -> object:
        if value is None and optional:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % step:
            raise ValueError(f"must be a positive multiple of {step}")
        return value

    return BeforeValidator(check)


def requirement(error: dict[str, Any], number: str) -> str:
    """What the value must be, from one of pydantic's error records (``number``: "an integer" or "a number",
    what the field holds)."""
    kind, ctx = error["type"], error.get("ctx", {})
    if kind == "greater_than":
        if ctx["gt"] == 0:
            return "must be a positive " + number.split(" ")[1]
        return f"must be {number} > {ctx['gt']}"
    bounds = {"greater_than_equal": ">=", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        bound = ctx.get("ge", ctx.get("le", ctx.get("lt")))
        return f"must be {number} {bounds[kind]} {bound}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind in ("dataclass_exact_type", "dataclass_type", "is_instance_of", "model_type"):
        return f"must be a {ctx.get('class_name', ctx.get('class', 'record'))}"
    plain = {
        "int_type": "must be an integer", "int_from_float": "must be an integer", "int_parsing": "must be an integer",
        "float_type": "must be a number", "float_parsing": "must be a number", "bool_type": "must be true or false",
        "string_type": "must be a string", "string_too_short": "must be a non-empty string",
        "too_short": "must not be empty",
        "finite_number": "must be a finite number", "list_type": "must be a list", "none_required": "must be None",
        "multiple_of": f"must be a multiple of {ctx.get('multiple_of')}",
        "unexpected_keyword_argument": "is not a field", "missing_argument": "is required", "missing": "is required",
    }
    if kind in plain:
        return plain[kind]
    return error["msg"][0].lower() + error["msg"][1:]


def _number_kinds(cls: type) -> dict[str, str]:
    """Each field of ``cls``: "an integer" where it holds an int, else "a number" (for the bounds' wording)."""
    kinds = {}
    for name, hint in get_type_hints(cls, include_extras=True).items():
        text = repr(hint)
        kinds[name] = "an integer" if re.search(r"\bint\b", text) and "float" not in text else "a number"
    return kinds


def readable_error(error: ValidationError, prefix: str = "", cls: type | None = None) -> str:
    """pydantic's report as one line a person reads: ``<prefix><field> must be ..., got <value>``.

    A union field (``int | None``, ``float | "auto"``) fails once per member: only the first is said, since
    the field's own docstring lists what it takes.
    """
    lines: list[str] = []
    seen: set[str] = set()
    kinds = _number_kinds(cls) if cls is not None else {}
    for e in error.errors(include_url=False):
        parts = list(e["loc"])
        if parts and isinstance(parts[0], int) and cls is not None:  # a positional argument: its field
            parts[0] = dataclasses.fields(cls)[parts[0]].name
        loc = [str(part) for part in parts if not isinstance(part, int)]
        # a union's member type shows up in the path ("num_kv_blocks.int"): keep the field's own path only
        name = prefix + ".".join([*loc[:1], *(p for p in loc[1:] if p.isidentifier() and p not in _TYPE_NAMES)])
        if not loc:  # a check of the whole record: its message names its fields itself
            lines.append(str(e.get("ctx", {}).get("error", e["msg"])))
            continue
        if name in seen:
            continue
        seen.add(name)
        if e["type"] == "value_error":  # a field's own check
            message = str(e.get("ctx", {}).get("error", e["msg"]))
            if loc[-1] in message:  # it names the field itself
                lines.append(message)
            elif message.startswith("must"):
                lines.append(f"{name} {message}, got {e['input']!r}")
            else:
                lines.append(f"{name}: {message}")
            continue
        if e["type"] == "unexpected_keyword_argument":
            owner = cls.__name__ if cls is not None else "the record"
            lines.append(f"{owner} has no field {name!r}")
            continue
        got = "" if e["type"] in ("missing_argument", "missing") else f", got {e['input']!r}"
        number = kinds.get(loc[0], "an integer" if isinstance(e.get("input"), int) else "a number")
        lines.append(f"{name} {requirement(e, number)}{got}")
    return "; ".join(lines)


# the member names pydantic puts in the path of a union's errors
_TYPE_NAMES = frozenset({"int", "float", "str", "bool", "none", "literal", "constrained-int", "constrained-float",
                         "function-before", "function-after", "function-wrap", "function-plain", "nullable"})


def config_record(cls: type[T] | None = None, *, prefix: str = "") -> Any:  # noqa: ANN401 (a decorator)
    """Make ``cls`` a frozen, strictly validated pydantic dataclass whose errors are ``ConfigError``.

    ``prefix``: put before a field's name in messages (``"grammar_limits."``), where the record is known
    by the name of the engine field that holds it.
    """

    def wrap(klass: type[T]) -> type[T]:
        config = ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True)
        record = pydantic_dataclass(frozen=True, config=config)(klass)
        validated_init: Callable[..., None] = record.__init__

        @functools.wraps(validated_init)
        def __init__(self: T, *args: object, **kwargs: object) -> None:
            try:
                validated_init(self, *args, **kwargs)
            except ValidationError as e:
                raise ConfigError(readable_error(e, prefix, record)) from None

        record.__init__ = __init__  # type: ignore[method-assign]
        return record

    return wrap if cls is None else wrap(cls)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's text from the ``Attributes:`` section of ``cls``'s docstring, joined into one paragraph."""
    doc = inspect.getdoc(cls) or ""
    _, _, args = doc.partition("\nAttributes:\n")
    docs: dict[str, str] = {}
    name = None
    for line in args.splitlines():
        match = re.match(r"^    (\w+):\s*(.*)$", line)
        if match:
            name = match.group(1)
            docs[name] = match.group(2)
        elif line.startswith("        ") and name is not None:
            docs[name] += " " + line.strip()
        elif line.strip():
            break  # the section ended
    return docs
