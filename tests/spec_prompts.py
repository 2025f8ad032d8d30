"""Prompts of the speculative-decoding tests, shared by the offline and the server tests.

``REPEAT``: the model is asked to repeat a Python function it is given (prompt
lookup drafts most of the answer). ``DOCUMENT_QA``: a paragraph of real text
nobody here wrote (the ``heapq`` module's docstring, from this Python's own
standard library) and a question whose answer quotes it, so drafts come from
the document.
"""

from __future__ import annotations

import heapq
import inspect

CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b
'''
REPEAT = [{"role": "user", "content": "Repeat this Python function exactly, with no changes:\n\n" + CODE}]

_HEAPQ_DOC = inspect.getdoc(heapq) or ""
# from "Our API differs ..." to the end: two bullet points and a closing sentence
DOCUMENT = _HEAPQ_DOC[_HEAPQ_DOC.index("Our API differs"):]
DOCUMENT_QA = [{
    "role": "user",
    "content": "Read this document:\n\n" + DOCUMENT + "\n\nQuestion: how does this API differ from textbook heap "
               "algorithms? Answer by quoting the document.",
}]
