"""A call whose arguments are built in pieces by its parser, not read as one JSON object.

Formats that do not write the arguments as a JSON object (Qwen3-Coder's XML
parameters, Python call syntax) or write it after the name (Mistral's
``name[ARGS]{...}``) produce the arguments text piece by piece. ``PieceCall``
sends those pieces under the streaming contract of ``base.py``: early
(streaming) the header goes out when the call opens and each piece as it is
made; buffered (``extract``) everything waits for ``complete()``. Either way
the pieces joined are the same text, so a stream reassembles into the
non-streamed answer.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser


class PieceCall:
    """One call being built: ``open()`` once its name is known, ``add(piece)`` per argument fragment, ``complete()``."""

    def __init__(self, parser: ToolParser, name: str, early: bool) -> None:
        if not name:
            raise ValueError("a tool call needs a name")
        self.name = name
        self._parser = parser
        self._early = early
        self._committed = False
        self._unsent: list[str] = []
        self.index: int | None = None

    @property
    def sent(self) -> bool:
        """Whether the header went out (a call past max_calls never does)."""
        return self.index is not None

    def open(self) -> None:
        """The name is known: a stream sends the header now."""
        if self._early:
            self._commit()

    def add(self, piece: str) -> None:
        """The next fragment of the arguments text: sent now if the call is committed, else kept."""
        if not self._committed:
            self._unsent.append(piece)
        elif self.index is not None:
            self._parser._send_arguments(self.index, piece)

    def complete(self) -> None:
        """The call is whole: commit it if it was not yet, and send what was kept."""
        if not self._committed:
            self._commit()
        unsent, self._unsent = self._unsent, []
        for piece in unsent:
            self.add(piece)

    def _commit(self) -> None:
        self._committed = True
        self.index = self._parser._open_call(self.name)
