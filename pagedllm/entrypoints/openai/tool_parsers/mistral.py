"""Mistral's tool calls: ``[TOOL_CALLS]`` and a JSON list, or ``[TOOL_CALLS]name[ARGS]{...}``.

Two generations of Mistral's format, both read:

- tokenizers before v11 (Mistral 7B v0.3, Mixtral 8x22B, Nemo)::

      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

  a JSON list of call objects (``name``, ``arguments`` an object; other keys
  such as ``id`` are ignored); a single object without the list is read too;
- v11 and later (Mistral Small 3.2, Magistral, Devstral)::

      [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

  one marker per call, the name, ``[ARGS]`` and the arguments object;
  a ``[CALL_ID]id`` between the name and ``[ARGS]`` (v13) is skipped.

``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` are special tokens, so they
are in the text only when special tokens are kept in the output
(``skip_special_tokens: false``), as for Llama 3's ``<|python_tag|>``.
Text before and after the calls is content (``tagged.py``); a block that is
not a call (invalid JSON, no name, arguments that are not an object, cut
short) stays content. The arguments are streamed as their raw text.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import StreamedCall
from pagedllm.entrypoints.openai.tool_parsers.json_scan import JsonLexer
from pagedllm.entrypoints.openai.tool_parsers.pieces import PieceCall
from pagedllm.entrypoints.openai.tool_parsers.tagged import TaggedToolParser

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_JSON_WS = " \t\n\r"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
_MAX_NAME_LEN = 256

# where the parser stands inside a block
_LEAD = "lead"  # after [TOOL_CALLS]: whitespace, then '[', '{' or a name
_ITEM = "item"  # in the list, after '[' or ',': a call object
_OBJECT = "object"  # inside a call object (list form)
_AFTER_ITEM = "after_item"  # after a call object of the list: ',' or ']'
_NAME = "name"  # a name, then [ARGS] or [CALL_ID]
_CALL_ID = "call_id"  # the id, then [ARGS]
_ARGS_LEAD = "args_lead"  # after [ARGS]: whitespace, then '{'
_ARGS = "args"  # the arguments object


class MistralToolParser(TaggedToolParser):
    """Mistral's ``[TOOL_CALLS]`` calls, both the JSON-list and the ``name[ARGS]{...}`` form; vLLM's ``mistral``."""

    name = "mistral"
    start = TOOL_CALLS
    drop_until = TOOL_CALLS

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._state = _LEAD
        self._listed = False  # the list form (else a lone object)
        self._objects: list[StreamedCall] = []  # the list form's calls in this block
        self._name: list[str] = []
        self._tag = ""
        self._call: PieceCall | None = None  # the name[ARGS] form's call
        self._lexer: JsonLexer | None = None

    def _open_block(self) -> None:
        self._state, self._listed, self._objects = _LEAD, False, []
        self._name, self._tag, self._call, self._lexer = [], "", None, None

    def _block_sent(self) -> bool:
        return any(c.sent for c in self._objects) or (self._call is not None and self._call.sent)

    def _block_at_end(self) -> bool:
        return False  # every complete form ends its block at its last character

    def _block_char(self, ch: str) -> None:
        state = self._state
        if state == _OBJECT:
            call = self._objects[-1]
            call.feed(ch)
            if call.scanner.done:
                if self._listed:
                    self._state = _AFTER_ITEM  # the list's calls are committed at its ']'
                else:
                    call.complete()
                    self._block_done()  # a lone object: the block ends with it
        elif state == _ARGS:
            self._lexer.feed(ch)
            self._call.add(ch)
            if self._lexer.done:
                self._call.complete()
                self._block_done()
        elif state in (_NAME, _CALL_ID):
            self._name_char(ch)
        elif ch in _JSON_WS:
            return
        elif state == _LEAD and ch in "[{" or state == _ITEM and ch == "{":
            if ch == "[":
                self._listed, self._state = True, _ITEM
                return
            self._objects.append(StreamedCall(self, ("arguments",), early=not self.buffered))
            self._objects[-1].feed(ch)
            self._state = _OBJECT
        elif state == _AFTER_ITEM and ch in ",]":
            if ch == ",":
                self._state = _ITEM
            else:
                for call in self._objects:
                    call.complete()
                self._block_done()
        elif state == _LEAD and ch in _NAME_CHARS:
            self._state, self._name = _NAME, [ch]
        elif state == _ARGS_LEAD and ch == "{":
            self._lexer = JsonLexer()
            self._lexer.feed(ch)
            self._call = PieceCall(self, "".join(self._name), early=not self.buffered)
            self._call.open()
            self._call.add(ch)
            self._state = _ARGS
        else:
            raise ValueError("not a Mistral tool call")

    def _name_char(self, ch: str) -> None:
        """A character of the name (or call id), or of the tag after it."""
        if not self._tag and ch in _NAME_CHARS and self._state == _NAME:
            if len(self._name) >= _MAX_NAME_LEN:
                raise ValueError("the tool call's name is too long")
            self._name.append(ch)
            return
        if not self._tag and self._state == _CALL_ID and ch != "[":
            return  # the id, skipped
        self._tag += ch
        tags = (ARGS, CALL_ID) if self._state == _NAME else (ARGS,)
        if self._tag == ARGS:
            self._tag, self._state = "", _ARGS_LEAD
        elif self._tag == CALL_ID and self._state == _NAME:
            self._tag, self._state = "", _CALL_ID
        elif not any(t.startswith(self._tag) for t in tags):
            raise ValueError("expected [ARGS] after the tool call's name")
