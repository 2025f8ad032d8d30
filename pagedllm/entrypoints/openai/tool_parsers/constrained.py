"""Reading the outputs that ``tool_choice`` forces with a grammar.

``tool_choice="required"`` and a named function do not rely on the model's
own call format: the output is constrained (``tool_choice.ToolSpec``
builds the schema), and these parsers turn it into calls:

- a named function: the whole output is the arguments object of that
  function; one call, its arguments the output text as is;
- ``"required"``: the output is a JSON array of ``{"name": ...,
  "parameters": {...}}``; each item is a call, its arguments the raw text of
  ``parameters``.

The grammar guarantees the shape, so there is nothing to fall back to: calls
are sent as soon as they can be, streamed or not, and a non-streamed answer
is exactly the joined stream. An output cut by ``max_tokens`` keeps the calls
begun so far, the last one with partial arguments (as vLLM returns it); its
finish reason says ``length``.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import DeltaMessage, StreamedCall, ToolParser

_JSON_WS = " \t\n\r"

_START = "start"  # before '['
_ITEM = "item"  # after '[' or ',': an item object
_OBJECT = "object"
_AFTER = "after"  # after an item: ',' or ']'
_END = "end"  # after ']'


class NamedFunctionParser(ToolParser):
    """The output of a request whose ``tool_choice`` names a function: one call to it.

    Args:
        function_name: the function ``tool_choice`` names.
    """

    name = "named_function"

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False, function_name: str = "") -> None:
        super().__init__(max_calls, buffered=buffered)
        if not isinstance(function_name, str) or not function_name:
            raise ValueError("NamedFunctionParser needs the function's name")
        self.function_name = function_name
        self._index: int | None = None

    def feed(self, text: str) -> DeltaMessage | None:
        """Every character is arguments: sent in one piece per feed (see ToolParser.feed)."""
        if self._finished:
            raise ValueError("feed() after finish()")
        if text:
            self._open()
            self._send_arguments(0, text)
        return self._take()

    def _open(self) -> None:
        if self._index is None:
            self._index = self._open_call(self.function_name)

    def _step(self, ch: str) -> None:
        self._open()
        self._send_arguments(0, ch)

    def _end(self) -> None:
        self._open()  # an empty output is still the one call, with empty arguments


class RequiredToolsParser(ToolParser):
    """The output of ``tool_choice="required"``: a JSON array of ``{"name", "parameters"}`` items, each a call."""

    name = "required_tools"

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._mode = _START
        self._call: StreamedCall | None = None

    def _step(self, ch: str) -> None:
        mode = self._mode
        if mode == _OBJECT:
            try:
                self._call.feed(ch)
            except ValueError:
                self._broken()
                return
            if self._call.scanner.done:
                self._call.complete()
                self._mode = _AFTER
        elif ch in _JSON_WS or mode == _END:
            if ch not in _JSON_WS:
                self._broken()
        elif mode == _START and ch == "[":
            self._mode = _ITEM
        elif mode == _ITEM and ch == "{":
            # always early: the grammar leaves nothing to take back
            self._call = StreamedCall(self, ("parameters",), early=True)
            self._call.feed(ch)
            self._mode = _OBJECT
        elif mode == _AFTER and ch in ",]":
            self._mode = _ITEM if ch == "," else _END
        else:
            self._broken()

    def _broken(self) -> None:
        # only a grammar that does not match the schema this parser reads can get here
        self.diverged = True
        self._mode = _END

    def _end(self) -> None:
        """A call cut short keeps what was sent of it; nothing else is pending."""
