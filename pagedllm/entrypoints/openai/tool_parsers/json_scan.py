"""Scanning a JSON object as it arrives, one character at a time.

A model writes a tool call's JSON a few characters per step. To stream the
arguments as OpenAI does, a parser must know after every character where it
stands: inside a string or not, at which depth, and whether the text so far
can still be valid JSON. ``JsonLexer`` answers that for one JSON object, with
the strict syntax of RFC 8259 (no NaN or Infinity, no control characters in
strings); ``CallScanner`` runs it over one call object ``{"name": ...,
"arguments": {...}}`` and keeps the raw text of its arguments, so that what
is streamed is, character for character, what the non-streamed answer holds.

Nothing here decodes more than it must: keys and the name are decoded with
``json.loads`` once their string closes; the arguments stay raw text.
"""

from __future__ import annotations

import json

_WS = frozenset(" \t\n\r")  # JSON's whitespace, no more
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CLOSERS = {"{": "}", "[": "]"}

# events of JsonLexer.feed, about what sits directly inside the top-level object
KEY_END = "key_end"  # a key's closing quote (the key began at ``key_start``)
VALUE_START = "value_start"  # this character begins a value
VALUE_END = "value_end"  # a value ended; ``value_end`` is one past its last character
DONE = "done"  # this character closed the top-level object

# lexer states: where the next character may go
_VALUE = "value"  # a value must start
_VALUE_OR_CLOSE = "value_or_close"  # after '[': a value or ']'
_KEY = "key"  # after ',' in an object: a key
_KEY_OR_CLOSE = "key_or_close"  # after '{': a key or '}'
_COLON = "colon"
_AFTER = "after"  # after a value inside a container: ',' or its closer
_STRING = "string"
_ESCAPE = "escape"
_UNICODE = "unicode"  # the hex digits of a \\u escape
_LITERAL = "literal"  # the rest of true, false or null
_NUMBER = "number"
_DONE = "done"

_NONE: tuple[str, ...] = ()


class JsonSyntaxError(ValueError):
    """The text can no longer become valid JSON."""


class JsonLexer:
    """A strict, incremental syntax check of one JSON object.

    ``feed`` takes the next character and returns the events it caused at
    depth 1 (keys and values directly inside the object); it raises
    JsonSyntaxError as soon as the text cannot be valid JSON any more, so a
    caller learns of a malformed call at the character where it breaks.
    Positions count characters fed, from 0.
    """

    def __init__(self) -> None:
        self.pos = -1  # index of the last character fed
        self.done = False
        self.key_start = -1  # where the last depth-1 key began (its opening quote)
        self.value_end = -1  # one past the last depth-1 value's last character
        self._stack: list[str] = []  # open containers, '{' or '['
        self._state = _VALUE
        self._string_is_key = False
        self._literal_left = ""
        self._hex_left = 0
        self._number = ""  # where inside a number: see _continue_number

    def feed(self, ch: str) -> tuple[str, ...]:
        """Take one character; the depth-1 events it caused (KEY_END, VALUE_START, VALUE_END, DONE)."""
        self.pos += 1
        state = self._state
        if state == _STRING:
            return self._string_char(ch)
        if state == _ESCAPE:
            if ch == "u":
                self._state, self._hex_left = _UNICODE, 4
            elif ch in _ESCAPES:
                self._state = _STRING
            else:
                raise self._error(ch, "an escape (one of \" \\ / b f n r t u)")
            return _NONE
        if state == _UNICODE:
            if ch not in _HEX:
                raise self._error(ch, "a hex digit")
            self._hex_left -= 1
            if self._hex_left == 0:
                self._state = _STRING
            return _NONE
        if state == _LITERAL:
            if ch != self._literal_left[0]:
                raise self._error(ch, f"{self._literal_left[0]!r} (true, false or null)")
            self._literal_left = self._literal_left[1:]
            return _NONE if self._literal_left else self._value_done(self.pos + 1)
        if state == _DONE:
            raise self._error(ch, "nothing: the object is complete")
        if state == _NUMBER:
            if self._continue_number(ch):
                return _NONE
            # the number ended before this character, which is read next as a separator
            return self._value_done(self.pos) + self._structural(ch)
        return self._structural(ch)

    def _error(self, ch: str, expected: str) -> JsonSyntaxError:
        return JsonSyntaxError(f"invalid JSON: {ch!r} at character {self.pos}, expected {expected}")

    def _structural(self, ch: str) -> tuple[str, ...]:
        """A character outside strings, numbers and literals."""
        if ch in _WS:
            return _NONE
        state = self._state
        if state == _AFTER:
            if ch == ",":
                self._state = _KEY if self._stack[-1] == "{" else _VALUE
                return _NONE
            return self._close(ch)
        if state == _COLON:
            if ch != ":":
                raise self._error(ch, "':'")
            self._state = _VALUE
            return _NONE
        if state in (_KEY, _KEY_OR_CLOSE):
            if ch == "}" and state == _KEY_OR_CLOSE:
                return self._close(ch)
            if ch != '"':
                raise self._error(ch, "a key (a string)")
            self._state, self._string_is_key = _STRING, True
            if len(self._stack) == 1:
                self.key_start = self.pos
            return _NONE
        if state == _VALUE_OR_CLOSE and ch == "]":
            return self._close(ch)
        return self._start_value(ch)

    def _start_value(self, ch: str) -> tuple[str, ...]:
        if not self._stack and ch != "{":
            raise self._error(ch, "'{' (a JSON object)")
        events = (VALUE_START,) if len(self._stack) == 1 else _NONE
        if ch in _CLOSERS:
            self._stack.append(ch)
            self._state = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        elif ch == '"':
            self._state, self._string_is_key = _STRING, False
        elif ch == "-" or ch in _DIGITS:
            self._state = _NUMBER
            self._number = "sign" if ch == "-" else "zero" if ch == "0" else "int"
        elif ch in _LITERALS:
            self._state, self._literal_left = _LITERAL, _LITERALS[ch]
        else:
            raise self._error(ch, "a value")
        return events

    def _close(self, ch: str) -> tuple[str, ...]:
        if ch not in ("}", "]") or _CLOSERS[self._stack[-1]] != ch:
            raise self._error(ch, f"',' or {_CLOSERS[self._stack[-1]]!r}")
        self._stack.pop()
        return self._value_done(self.pos + 1)

    def _value_done(self, end: int) -> tuple[str, ...]:
        """A value (scalar or container) just ended, ``end`` being one past its last character."""
        if not self._stack:
            self.done, self._state = True, _DONE
            return (DONE,)
        self._state = _AFTER
        if len(self._stack) == 1:
            self.value_end = end
            return (VALUE_END,)
        return _NONE

    def _string_char(self, ch: str) -> tuple[str, ...]:
        if ch == '"':
            if self._string_is_key:
                self._state = _COLON
                return (KEY_END,) if len(self._stack) == 1 else _NONE
            return self._value_done(self.pos + 1)
        if ch == "\\":
            self._state = _ESCAPE
        elif ch < " ":
            raise self._error(ch, "no control character inside a string")
        return _NONE

    def _continue_number(self, ch: str) -> bool:
        """Whether ``ch`` continues the number; raises when the number cannot end here.

        States follow JSON's grammar ``-? (0 | [1-9][0-9]*) (.[0-9]+)? ([eE][+-]?[0-9]+)?``:
        sign, zero, int, frac0 (after '.'), frac, exp0 (after 'e'), expsign, exp.
        """
        s, digit = self._number, ch in _DIGITS
        if s == "sign":
            nxt = ("zero" if ch == "0" else "int") if digit else None
        elif s in ("zero", "int", "frac", "exp"):
            if digit and s != "zero":
                return True
            if s in ("zero", "int") and ch == ".":
                nxt = "frac0"
            elif s != "exp" and ch in "eE":
                nxt = "exp0"
            else:
                return False  # a complete number ends here
        elif s in ("frac0", "expsign"):
            nxt = ("frac" if s == "frac0" else "exp") if digit else None
        else:  # exp0
            nxt = "exp" if digit else "expsign" if ch in "+-" else None
        if nxt is None:
            raise self._error(ch, "a digit")
        self._number = nxt
        return True


class CallFormatError(ValueError):
    """Valid JSON so far, but not a tool call object (no name, arguments not an object...)."""


class CallScanner:
    """One tool-call object read as its characters arrive: its name and the raw text of its arguments.

    Args:
        args_keys: the keys that may hold the arguments object (Hermes writes
            ``arguments``, Llama 3 ``parameters``); one of them at most.

    ``feed`` raises JsonSyntaxError or CallFormatError (both ValueErrors) at
    the character where the text stops being a call. Keys other than
    ``name`` and the arguments are allowed and ignored.
    """

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self._lexer = JsonLexer()
        self._args_keys = args_keys
        self._chars: list[str] = []  # the object's text so far (a list: appending to a str attribute copies it)
        self.name: str | None = None
        self._keys: set[str] = set()
        self._key: str | None = None  # the depth-1 key whose value is being read
        self._value_start = -1
        self._args_start = -1
        self._args_end = -1

    @property
    def done(self) -> bool:
        """Whether the object has closed (with a name)."""
        return self._lexer.done

    @property
    def args_started(self) -> bool:
        """Whether the arguments object has begun."""
        return self._args_start >= 0

    @property
    def text(self) -> str:
        """The object's text so far."""
        return "".join(self._chars)

    @property
    def arguments(self) -> str:
        """The raw text of the arguments so far; ``{}`` for a finished call that has none."""
        return self.arguments_from(0)

    def arguments_from(self, offset: int) -> str:
        """The arguments' raw text from character ``offset`` on (what a stream has not sent yet)."""
        if self._args_start < 0:
            return "{}"[offset:] if self.done else ""
        end = self._args_end if self._args_end >= 0 else len(self._chars)
        return "".join(self._chars[self._args_start + offset : end])

    def feed(self, ch: str) -> None:
        """Take the object's next character; ValueError when the text stops being a call."""
        events = self._lexer.feed(ch)
        self._chars.append(ch)
        for event in events:
            if event == KEY_END:
                key = json.loads("".join(self._chars[self._lexer.key_start :]))
                if key in self._keys:
                    raise CallFormatError(f"the tool call has the key {key!r} twice")
                self._keys.add(key)
                self._key = key
            elif event == VALUE_START:
                self._value_start = self._lexer.pos
                if self._key == "name" and ch != '"':
                    raise CallFormatError("the tool call's name must be a string")
                if self._key in self._args_keys:
                    if self._args_start >= 0:
                        raise CallFormatError("the tool call has its arguments twice")
                    if ch != "{":
                        raise CallFormatError("the tool call's arguments must be a JSON object")
                    self._args_start = self._lexer.pos
            elif event == VALUE_END:
                self._value_end(self._lexer.value_end)
            elif event == DONE and self.name is None:
                raise CallFormatError("the tool call has no name")

    def _value_end(self, end: int) -> None:
        if self._key == "name":
            name = json.loads("".join(self._chars[self._value_start : end]))
            if not name:
                raise CallFormatError("the tool call's name is empty")
            self.name = name
        elif self._key in self._args_keys:
            self._args_end = end
