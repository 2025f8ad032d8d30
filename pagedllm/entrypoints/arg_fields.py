"""Command-line flags generated from a configuration record's fields (``config_record.py``).

A field ``max_num_seqs`` becomes ``--max-num-seqs``: its type gives the flag's parser (``int``, ``float``,
``str``), a ``Literal`` its choices, a bool the pair ``--flag`` / ``--no-flag``, a nested record (such as
``grammar_limits``) one flag per field of its own under a prefix (``--grammar-max-bytes``). The help is
the first sentence of the field's entry in the record's ``Attributes:`` docstring, followed by its default, so
a field is documented once and the command line cannot drift from the library.

A flag left out is not set at all (``argparse.SUPPRESS``): the library then applies its own default, so
the defaults, too, are written once. ``record_kwargs`` reads the flags given back into keyword arguments.

A field whose flag is not named as the field says, or whose text means something else than the value
(``--stream-write-timeout 0``: no bound, None), carries a ``Flag`` in its annotation
(``Annotated[float, Flag("--header-timeout", ...)]``); pydantic ignores it, the command line reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from pagedllm.config_record import field_docs


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a record field appears on the command line where its name and type do not say it all.

    Args:
        name: the option, where it is not ``--<field-name>`` (``--served-model-name``).
        parser: reads the flag's text into the field's value (``"0"`` -> None, ``"a,b"`` -> a list) when
            the record is built (``record_kwargs``), so that a ValueError it raises is a refused value,
            as the record's own, naming the flag.
        metavar: the value's name in ``--help``.
        default: the default as ``--help`` shows it, where the record's own would mislead.
        prefix: for a nested record, the prefix of its fields' flags (default: the field's first word).
        skip: no flag: the command sets the field itself (a name read from the model, a timestamp).
        nargs: argparse's ``nargs`` (``"+"``: one or more values, handed to ``parser`` as a list).
    """

    name: str | None = None
    parser: Callable[[str], object] | None = None
    metavar: str | None = None
    default: str | None = None
    prefix: str | None = None
    skip: bool = False
    nargs: str | None = None


NO_FLAG = Flag(skip=True)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def field_flag(cls: type, name: str) -> Flag:
    """The ``Flag`` in the annotation of ``cls``'s field ``name`` (outermost ``Annotated``), or a plain one."""
    hint = _hints(cls)[name]
    if get_origin(hint) is Annotated:
        for meta in get_args(hint)[1:]:
            if isinstance(meta, Flag):
                return meta
    return Flag()


def _nested_prefix(cls: type, name: str, prefix: str) -> str:
    """The flag prefix of the fields of ``cls``'s nested record ``name`` (``grammar_limits`` -> ``grammar-``)."""
    own = field_flag(cls, name).prefix
    return prefix + (name.split("_")[0] + "-" if own is None else own)


def _strip(hint: Any) -> tuple[Any, bool]:  # noqa: ANN401 (a typing form)
    """(the type without ``Annotated`` and ``| None``, whether None is allowed)."""
    optional = False
    while True:
        if get_origin(hint) is Annotated:
            hint = get_args(hint)[0]
        elif get_origin(hint) in (Union, types.UnionType):
            args = [a for a in get_args(hint) if a is not type(None)]
            optional = optional or len(args) < len(get_args(hint))
            if len(args) != 1:
                return args, optional  # a union of several types: the caller gives the flag a parser
            hint = args[0]
        else:
            return hint, optional


def first_sentence(text: str) -> str:
    """The text up to its first full stop followed by a space (or all of it)."""
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return (text[: match.start() + 1] if match else text).replace("``", "")


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def flag_name(field: str, prefix: str = "") -> str:
    """``max_num_seqs`` -> ``--max-num-seqs`` (``prefix`` "grammar-": ``--grammar-max-bytes``)."""
    return "--" + prefix + field.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class FieldFlag:
    """One generated flag: the record field it sets (``key``: its name, under its record's prefix for a
    nested record's field), the flag, where argparse puts its value, and whether it stands for a nested
    record whose own fields have flags."""

    key: str
    flag: str
    dest: str
    nested: bool = False
    parse: Callable[[str], object] | None = None


def add_record_arguments(
    group: argparse._ActionsContainer,
    cls: type,
    *,
    prefix: str = "",
    skip: tuple[str, ...] = (),
    parsers: dict[str, Callable[[str], object]] | None = None,
    defaults: dict[str, str] | None = None,
    aliases: dict[str, tuple[str, ...]] | None = None,
    taken: Callable[[str], bool] = lambda flag: False,
) -> list[FieldFlag]:
    """Add a flag to ``group`` for every field of the record ``cls`` but ``skip``; the flags added.

    ``parsers``: a field's own text parser (for a union of types); ``defaults``: the default to show in
    the help where the caller applies another than the record's (``LLM``'s); ``aliases``: extra option
    strings of a field; ``taken``: whether a flag name is used already by the command (then the field's
    flag is ``--engine-<name>``).
    """
    docs, hints = field_docs(cls), _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        marker = field_flag(cls, f.name)
        if f.name in skip or marker.skip:
            continue
        key = prefix.replace("-", "_") + f.name
        flag, dest = marker.name or flag_name(f.name, prefix), key
        if taken(flag):  # the command has a flag of that name already (generate's per-request --seed)
            flag, dest = flag_name(f.name, "engine-" + prefix), "engine_" + key
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        shown = (defaults or {}).get(f.name, marker.default or _show(default))
        text = first_sentence(docs.get(f.name, "")).replace("%", "%%") or f.name.replace("_", " ")
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": f"{text} (default: {shown})"}
        if marker.metavar is not None:
            kwargs["metavar"] = marker.metavar
        if marker.nargs is not None:
            kwargs["nargs"] = marker.nargs
        hint, _ = _strip(hints[f.name])
        if f.name in (parsers or {}):
            kwargs["type"] = parsers[f.name]
        elif marker.parser is not None:
            kwargs["type"] = str  # read by the marker's parser in record_kwargs
        elif hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(hint) is Literal:
            kwargs["choices"] = list(get_args(hint))
        elif hint in (int, float, str):
            kwargs["type"] = hint
        elif dataclasses.is_dataclass(hint):
            out.append(FieldFlag(key, flag, dest, nested=True))  # the record's own flags, under its name
            out.extend(add_record_arguments(group, hint, prefix=_nested_prefix(cls, f.name, prefix), taken=taken))
            continue
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for type {hint!r}; give it a parser")
        group.add_argument(flag, *(aliases or {}).get(f.name, ()), **kwargs)
        out.append(FieldFlag(key, flag, dest, parse=marker.parser))
    return out


def record_kwargs(args: argparse.Namespace, cls: type, flags: list[FieldFlag], prefix: str = "") -> dict[str, Any]:
    """The keyword arguments of ``cls`` that the flags given set (a nested record built from its own)."""
    by_key = {flag.key: flag for flag in flags}
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        flag = by_key.get(prefix + f.name)
        if flag is None:
            continue
        if flag.nested:
            record, _ = _strip(_hints(cls)[f.name])
            inner_prefix = _nested_prefix(cls, f.name, prefix.replace("_", "-")).replace("-", "_")
            inner = record_kwargs(args, record, flags, inner_prefix)
            if inner:
                kwargs[f.name] = record(**inner)
        elif hasattr(args, flag.dest):
            kwargs[f.name] = _parsed(flag, getattr(args, flag.dest))
    return kwargs


def _parsed(flag: FieldFlag, value: object) -> object:
    """A flag's value through its field's ``Flag.parser`` (if any); its ValueError names the flag."""
    if flag.parse is None:
        return value
    try:
        return flag.parse(value)
    except ValueError as e:
        raise ValueError(f"{flag.flag} {e}") from None
