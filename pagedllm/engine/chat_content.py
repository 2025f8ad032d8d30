"""A chat message's ``content`` as the one string a chat template reads.

OpenAI (and vLLM) let content be a string or a list of parts
(``[{"type": "text", "text": ...}, {"type": "image_url", ...}]``). The text
parts are joined by newlines, the way vLLM renders them for a template that
takes a string. The models pagedllm serves read text only, so any other part
(an image, audio, a file) is refused with a sentence that says so, never
dropped: the model would answer without having seen it.

Shared by ``LLM.chat`` and the server (``entrypoints/openai/tool_messages.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# the media parts OpenAI and vLLM define, named in the refusal by what they carry
_MEDIA = {"image_url": "images", "image": "images", "image_pil": "images", "input_image": "images",
          "input_audio": "audio", "audio_url": "audio", "video_url": "video", "file": "files"}


def content_text(content: object, where: str = "content") -> str:
    """``content`` (a string, or a list of text parts) as one string; ValueError naming ``where`` otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _MEDIA:
            raise ValueError(f"{where}[{j}] is a {kind!r} part: this model takes no {_MEDIA[kind]}, "
                             "only text; send text parts {'type': 'text', 'text': ...}")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}] must be a text part {{'type': 'text', 'text': ...}} "
                             "(only text content is supported)")
        texts.append(part["text"])
    return "\n".join(texts)
