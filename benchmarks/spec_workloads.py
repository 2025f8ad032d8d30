"""The speculative-decoding workloads: chat conversations from text nobody here wrote.

One place for ``benchmarks/spec_decode.py`` (ours) and ``benchmarks/peers/llama_cpp/spec_peer.py``
(llama-server against ours), so both send the same prompts. Standard library only (the peer
script's llama.cpp side needs no torch). The texts come from the running Python's standard
library (its sources and docstrings) and from ``/usr/share/common-licenses``, so they are the
same wherever the Python version and the Debian ``base-files`` are; the measured turn is always
the conversation's last user message.

- ``code-edit``: a standard-library function pasted, "repeat it renamed" (the answer copies it).
- ``doc-qa``: a module docstring or a license text pasted as a document, then a question whose
  answer quotes it.
- ``multi-turn-code``: the user asks for a function, the assistant "wrote" a standard-library
  function's source, the user asks what it does and the assistant answers with its docstring,
  then the user asks for a change to the code above (type hints, handling None, ...).
- ``open-chat``: open-ended questions, nothing to copy.
"""

from __future__ import annotations

import csv
import difflib
import fnmatch
import heapq
import inspect
import json
import shelve
import shutil
import socketserver
import statistics
import textwrap

CODE_FUNCTIONS = [textwrap.dedent, textwrap.indent, inspect.cleandoc, statistics.median, json.dumps]
CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python? Explain briefly.",
]
LICENSES = "/usr/share/common-licenses"
# (document: a module, whose docstring is pasted, or a file under LICENSES; the question)
DOC_QUESTIONS = [
    (socketserver, "According to the document, when does it make no sense to use a forking server, and "
                   "why? Quote the sentence that says so."),
    (shelve, "Why does d[key].append(anitem) have no effect on a shelf, and what does the document say to "
             "do instead? Quote the relevant passage."),
    (csv, "What does each of the quoting constants QUOTE_MINIMAL, QUOTE_ALL, QUOTE_NONNUMERIC and QUOTE_NONE "
          "mean? Quote the document's description of each."),
    (heapq, "How does this API differ from textbook heap algorithms? Quote the document."),
    ("BSD", "Quote the three conditions for redistribution exactly as the license states them."),
]
# (the function the assistant "wrote", the change the last turn asks for)
REVISITS = [
    (difflib.get_close_matches, "Add type hints to the function you wrote above."),
    (heapq.nlargest, "Now make the function you wrote above return an empty list when iterable is None."),
    (fnmatch.filter, "Change the function you wrote above so that names=None gives an empty list."),
    (textwrap.shorten, "Make the function you wrote above raise ValueError when width is not positive."),
    (shutil.copyfileobj, "Add type hints to the function you wrote above and rename fsrc and fdst to "
                         "source and destination."),
]
WORKLOADS = ("code-edit", "doc-qa", "multi-turn-code", "open-chat")


def function_source(fn, limit: int = 1500) -> str:
    """A function's source, dedented, cut at a line end to ``limit`` characters (a few hundred tokens)."""
    source = textwrap.dedent(inspect.getsource(fn))
    if len(source) > limit:
        source = source[:limit].rsplit("\n", 1)[0]
    return source


def document(source) -> str:
    """A module's docstring, or a license text by its file name under ``/usr/share/common-licenses``."""
    if isinstance(source, str):
        with open(f"{LICENSES}/{source}", encoding="utf-8") as f:
            return f.read().strip()
    return inspect.getdoc(source)


def code_edit() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Repeat this Python function exactly, but rename it to "
              f"`{fn.__name__}_v2`:\n\n```python\n{function_source(fn)}\n```"}] for fn in CODE_FUNCTIONS]


def doc_qa() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Here is a document:\n\n\"\"\"\n{document(source)}\n\"\"\"\n\n{question}"}]
            for source, question in DOC_QUESTIONS]


def multi_turn_code() -> list[list[dict]]:
    conversations = []
    for fn, change in REVISITS:
        doc = inspect.getdoc(fn)
        conversations.append([
            {"role": "user", "content": f"Write a Python function `{fn.__name__}{inspect.signature(fn)}`: "
                                        f"{doc.splitlines()[0]}"},
            {"role": "assistant", "content": f"```python\n{function_source(fn)}\n```"},
            {"role": "user", "content": "What does it do, in a few sentences?"},
            {"role": "assistant", "content": doc},
            {"role": "user", "content": f"{change} Show the whole function again."},
        ])
    return conversations


def open_chat() -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]


def workloads(names: list[str] | None = None) -> dict[str, list[list[dict]]]:
    """Chat conversations by workload name, in ``WORKLOADS``' order; ``names`` picks some (unknown: ValueError)."""
    unknown = set(names or ()) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    make = {"code-edit": code_edit, "doc-qa": doc_qa, "multi-turn-code": multi_turn_code, "open-chat": open_chat}
    return {name: make[name]() for name in WORKLOADS if names is None or name in names}


def workload_names(text: str) -> list[str]:
    """``--workloads`` parsed (an argparse type): comma-separated names from ``WORKLOADS``."""
    import argparse

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    return names
