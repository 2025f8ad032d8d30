"""The server's tokenizer, in a child process of its own.

Tokenizing is the one piece of a request whose cost the client chooses: a
16 MB prompt takes tens of seconds of CPU. Done on the engine thread it
stopped every stream for that long; done on another thread of the server
process it still holds the GIL in long C calls (building the id list, freeing
the Rust encoding, serialising the ids: about 2 s for 16 MB, measured), and
every thread of the process waits. So the server's text <-> token work runs
in one spawned process with its own ``tokenizers.Tokenizer`` (the same
``tokenizer.json`` the engine's tokenizer was built from), and only bytes
cross back: ids as a packed int32 array, or a ready JSON fragment. Chat
templates render in the server process (plain Python string work, which
yields the GIL) and their text is tokenized here like any prompt.

One child is one queue, though: a short prompt sent during a 16 MB tokenize
waited for it (20 s, measured). So a short text (under ``SHORT_TEXT_CHARS``,
whose GIL-holding parts take a few milliseconds at most) is encoded in the
server process instead, on a worker thread with a tokenizer of its own, and
only the long ones queue for the child.

The engine keeps its own tokenizer for detokenizing outputs as they are
generated (short, incremental).
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import json
import multiprocessing
import shutil
import tempfile
from pathlib import Path
from typing import Any

# the child's tokenizer, set by _init (one per worker process)
_TOKENIZER: Any = None

# texts shorter than this (characters) and id lists shorter than SHORT_IDS are done in the server
# process: ~8k tokens, whose id list and JSON take ~1-3 ms of GIL to build (a 16 MB text: ~2 s)
SHORT_TEXT_CHARS = 32 << 10
SHORT_IDS = 8 << 10


def _init(path: str) -> None:
    global _TOKENIZER  # noqa: PLW0603 - the worker process's one tokenizer
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_file(path)


def _encode(text: str, add_special_tokens: bool, limit: int | None, tokenizer: Any = None) -> tuple[int, bytes | None]:
    """(token count, int32 ids) of ``text``; the ids are left out when there are ``limit`` or more."""
    # encode_batch, not encode: it releases the GIL (this process answers the pool's pipe meanwhile)
    ids = (tokenizer or _TOKENIZER).encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    if limit is not None and len(ids) >= limit:
        return len(ids), None
    return len(ids), array.array("i", ids).tobytes()


def _tokenize_json(text: str, add_special_tokens: bool, with_strs: bool,
                   tokenizer: Any = None) -> tuple[int, bytes, bytes]:
    """(count, JSON list of ids, JSON list of token strings or ``null``) for ``/tokenize``."""
    encoding = (tokenizer or _TOKENIZER).encode_batch([text], add_special_tokens=add_special_tokens)[0]
    strs = json.dumps(encoding.tokens, ensure_ascii=False).encode() if with_strs else b"null"
    return len(encoding.ids), json.dumps(encoding.ids).encode(), strs


def _decode(token_ids: bytes, tokenizer: Any = None) -> str:
    return (tokenizer or _TOKENIZER).decode(array.array("i", token_ids).tolist(), skip_special_tokens=False)


def _ping() -> bool:
    return _TOKENIZER is not None


class TokenizerWorker:
    """Encode and decode for the server in a spawned child process.

    Args:
        hf_tokenizer: the engine's Hugging Face (fast) tokenizer; its
            ``tokenizer.json`` is saved to a private folder for the child.
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self._dir = tempfile.mkdtemp(prefix="pagedllm-tokenizer-")
        try:
            hf_tokenizer.backend_tokenizer.save(str(Path(self._dir) / "tokenizer.json"))
            context = multiprocessing.get_context("spawn")  # never fork a process with torch's threads
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=context, initializer=_init, initargs=(str(Path(self._dir) / "tokenizer.json"),)
            )
            self._pool.submit(_ping)  # start the child now, not on the first request
            from tokenizers import Tokenizer

            # the short texts' own copy: the engine's is not shared across threads (its HF wrapper sets
            # truncation and padding on it per call)
            self._local = Tokenizer.from_file(str(Path(self._dir) / "tokenizer.json"))
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    async def _run(self, short: bool, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a thread of this process when ``short``, else in the child (one queue)."""
        if short:
            return await asyncio.to_thread(fn, *args, self._local)
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    async def encode(self, text: str, add_special_tokens: bool, limit: int | None = None) -> tuple[int, list[int] | None]:
        """(token count, ids) of ``text``; ids is None when the count reaches ``limit``.

        A prompt too long for the context is refused from its count alone,
        without building its id list here.
        """
        count, packed = await self._run(len(text) < SHORT_TEXT_CHARS, _encode, text, add_special_tokens, limit)
        return count, None if packed is None else array.array("i", packed).tolist()

    async def tokenize_json(self, text: str, add_special_tokens: bool, with_strs: bool) -> tuple[int, bytes, bytes]:
        """(count, ids as a JSON list, token strings as a JSON list or ``null``)."""
        return await self._run(len(text) < SHORT_TEXT_CHARS, _tokenize_json, text, add_special_tokens, with_strs)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens kept (``/detokenize``)."""
        return await self._run(len(token_ids) < SHORT_IDS, _decode, array.array("i", token_ids).tobytes())

    def close(self) -> None:
        """Stop the child process and remove its folder."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self._dir, ignore_errors=True)
