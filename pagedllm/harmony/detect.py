"""Whether a model speaks harmony: gpt-oss by its architecture, or a chat template written in harmony's markers."""

from __future__ import annotations

from collections.abc import Iterable

HF_ARCHITECTURES = ("GptOssForCausalLM",)
GGUF_ARCHITECTURES = ("gpt-oss",)
# harmony's channel marker: no other chat format uses it
TEMPLATE_MARKER = "<|channel|>"


def is_harmony_model(
    architecture: str | None, architectures: Iterable[str] = (), chat_template: str | None = None
) -> bool:
    """True for a gpt-oss checkpoint (HF ``GptOssForCausalLM``, GGUF ``gpt-oss``) or a harmony chat template."""
    if architecture in GGUF_ARCHITECTURES or architecture == "gpt_oss":
        return True
    if any(a in HF_ARCHITECTURES for a in architectures):
        return True
    return isinstance(chat_template, str) and TEMPLATE_MARKER in chat_template
