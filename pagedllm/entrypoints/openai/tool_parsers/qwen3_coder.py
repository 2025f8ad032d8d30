"""Qwen3-Coder's XML tool calls, typed by the tools' JSON schemas.

The format Qwen3-Coder's chat template asks for::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Each block is one call; its parameters become the arguments object, in the
order written. A value is the text between ``<parameter=NAME>`` and
``</parameter>``, less the one newline the template puts after the opening
tag and the one before the closing tag. It is typed by the parameter's
schema in the request's tools (``typed_value``): a ``string`` stays the text,
``integer``/``number``/``boolean``/``null``/``object``/``array`` are parsed
(JSON, or a Python literal as the model sometimes writes), and a value that
does not parse, or a parameter the schema does not name, stays a string.

Text outside the blocks is content (``tagged.py``). A block that breaks the
syntax (no ``<function=``, a parameter without ``</parameter>``, text
between tags, the same parameter twice, cut short) stays content. A block
may lack its ``</tool_call>`` when the output ends after ``</function>``.
Streamed, a call's header goes out when its name is read and each parameter
as ``"name": value`` when it closes; ``}`` when the function closes.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.pieces import PieceCall
from pagedllm.entrypoints.openai.tool_parsers.tagged import TaggedToolParser

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

# where the parser stands inside a block
_OPEN = "open"  # after <tool_call>: whitespace, then <function=
_NAME = "name"  # the function's name, up to '>'
_BODY = "body"  # inside the function: whitespace, then <parameter= or </function>
_PARAM = "param"  # a parameter's name, up to '>'
_VALUE = "value"  # a parameter's value, up to </parameter>
_AFTER = "after"  # after </function>: whitespace, then </tool_call>
_NAME_STOP = frozenset("<>\n\r\t ")
_MAX_NAME_LEN = 256


def _schema_types(schema: Mapping[str, Any] | None) -> list[str]:
    """The JSON types a property schema allows (``type``, or the types of ``anyOf``/``oneOf`` branches)."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            types.extend(_schema_types(branch))
    if not types and "enum" in schema:
        types = sorted({_json_type(v) for v in schema["enum"]})
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {dict: "object", list: "array"}.get(type(value), "string")


def _loose_literal(raw: str) -> Any:
    """JSON, else a Python literal (``True``, single quotes); ValueError when it is neither."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a literal: {raw[:40]!r}") from e
    json.dumps(value, allow_nan=False)  # TypeError/ValueError for sets, bytes, nan...
    return value


def typed_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the value its schema asks for; the text itself when it does not parse as one."""
    types = _schema_types(schema)
    if not types or "string" in types:
        return None if raw == "null" and "null" in types else raw  # ["string", "null"]: null is null
    try:
        value = _loose_literal(raw.strip())
    except (ValueError, TypeError):
        return raw
    actual = _json_type(value)
    for kind in types:
        if actual == kind or (kind == "number" and actual == "integer"):
            return value
        if kind == "integer" and actual == "number" and math.isfinite(value) and value == int(value):
            return int(value)
    return raw


class Qwen3CoderToolParser(TaggedToolParser):
    """Qwen3-Coder's ``<tool_call><function=NAME><parameter=ARG>`` calls; vLLM's ``qwen3_coder`` parser.

    Args:
        tools: the request's function tools (objects with ``name`` and
            ``parameters``, as ``tool_choice.FunctionTool``), whose schemas
            type the values; None: every value is a string.
    """

    name = "qwen3_coder"
    start = START
    drop_until = END
    needs_tools = True

    def __init__(
        self, max_calls: int | None = None, *, buffered: bool = False, tools: Sequence[Any] | None = None
    ) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._schemas: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            params = getattr(tool, "parameters", None)
            props = params.get("properties") if isinstance(params, Mapping) else None
            self._schemas[tool.name] = props if isinstance(props, Mapping) else {}
        self._state = _OPEN
        self._tag = ""  # the part of the tag being matched
        self._text: list[str] = []  # the name or value being read
        self._call: PieceCall | None = None
        self._param = ""
        self._params: set[str] = set()

    def _open_block(self) -> None:
        self._state, self._tag, self._text, self._call, self._params = _OPEN, "", [], None, set()

    def _block_sent(self) -> bool:
        return self._call is not None and self._call.sent

    def _block_at_end(self) -> bool:
        if self._state != _AFTER:
            return False
        self._block_done()
        return True

    def _block_char(self, ch: str) -> None:
        state = self._state
        if state == _VALUE:
            self._value_char(ch)
        elif state in (_NAME, _PARAM):
            self._name_char(ch)
        elif self._tag or not ch.isspace():
            self._tag += ch
            tags = {_OPEN: (FUNCTION,), _BODY: (PARAMETER, FUNCTION_END), _AFTER: (END,)}[state]
            if self._tag in tags:
                tag, self._tag = self._tag, ""
                self._tag_done(tag)
            elif not any(t.startswith(self._tag) for t in tags):
                raise ValueError(f"expected one of {tags} in a tool call block")

    def _tag_done(self, tag: str) -> None:
        if tag in (FUNCTION, PARAMETER):
            self._state, self._text = (_NAME if tag == FUNCTION else _PARAM), []
        elif tag == FUNCTION_END:
            self._call.add("}" if self._params else "{}")
            self._call.complete()
            self._state = _AFTER
        else:  # END
            self._block_done()

    def _name_char(self, ch: str) -> None:
        if ch != ">":
            if ch in _NAME_STOP or len(self._text) >= _MAX_NAME_LEN:
                raise ValueError("a function or parameter name must be one word, closed by '>'")
            self._text.append(ch)
            return
        name, self._text = "".join(self._text), []
        if not name:
            raise ValueError("an empty function or parameter name")
        if self._state == _NAME:
            self._call = PieceCall(self, name, early=not self.buffered)
            self._call.open()
            self._state = _BODY
        else:
            if name in self._params:
                raise ValueError(f"the parameter {name!r} is written twice")
            self._param, self._state = name, _VALUE

    def _value_char(self, ch: str) -> None:
        self._tag += ch
        if self._tag == PARAMETER_END:
            self._tag = ""
            self._param_done()
            return
        while self._tag and not PARAMETER_END.startswith(self._tag):
            self._text.append(self._tag[0])
            self._tag = self._tag[1:]

    def _param_done(self) -> None:
        raw, self._text = "".join(self._text), []
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        schema = self._schemas.get(self._call.name, {}).get(self._param)
        value = typed_value(raw, schema)
        lead = ", " if self._params else "{"
        self._params.add(self._param)
        self._call.add(f"{lead}{json.dumps(self._param, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        self._state = _BODY
