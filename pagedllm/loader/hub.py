"""Models named by Hugging Face repo id, fetched through ``huggingface_hub``.

``org/repo`` names a Hugging Face folder model (config, tokenizer, generation
config, chat template and safetensors files are downloaded, nothing else) or
a GGUF repo. A GGUF repo is named as llama.cpp names it: ``org/repo:Q4_K_M``,
the tag picking the one GGUF file (case-insensitive) among several, or with
``gguf_file`` naming the file; only that file (and its split parts) is
downloaded. ``huggingface_hub`` does the rest as it does for transformers:
its cache (``HF_HOME``, ``HF_HUB_CACHE``), ``HF_HUB_OFFLINE``, ``HF_TOKEN``,
the revision, its progress bars.
"""

from __future__ import annotations

import os
import re

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from pagedllm.loader.gguf_split import SPLIT_RE

# what a folder model needs: its config, tokenizer, sampling defaults, chat template and weights
FOLDER_PATTERNS = (
    "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "*.model", "chat_template.json", "chat_template.jinja",
    "*.safetensors", "*.safetensors.index.json",
)
# llama.cpp's default pick among a repo's quantizations when the name gives no tag
DEFAULT_GGUF_TAG = "Q4_K_M"
_REPO_RE = re.compile(r"^(?P<repo>[^:/\s]+/[^:/\s]+)(?::(?P<tag>[^:/\s]+))?$")


def looks_like_repo_id(model: str) -> bool:
    """Whether ``model`` has the form ``org/repo`` or ``org/repo:TAG`` (not whether it exists)."""
    return _REPO_RE.match(model) is not None


def resolve_repo(model: str, *, revision: str | None = None, gguf_file: str | None = None) -> str:
    """The local path (a folder or a GGUF file's first part) of repo ``model``, downloaded if need be.

    ValueError, saying what to do, for a name that is no repo id, a repo or
    revision that does not exist, a tag no file matches, or a model neither
    cached nor downloadable (offline).
    """
    match = _REPO_RE.match(model)
    if match is None:
        raise ValueError(f"model {model!r} is neither a local path (a .gguf file or a folder with config.json) "
                         "nor a Hugging Face repo id (org/repo, or org/repo:QUANT for a GGUF repo)")
    repo_id, tag = match["repo"], match["tag"]
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"model {model!r} is neither a local path nor a valid Hugging Face repo id: {e}") from e
    if tag is not None and gguf_file is not None:
        raise ValueError(f"model {model!r} names a quantization tag and gguf_file={gguf_file!r} too: give one")
    try:
        files = _repo_files(repo_id, revision)
        if gguf_file is None and tag is None and "config.json" in files:
            folder = _download(repo_id, revision, list(FOLDER_PATTERNS))
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise LocalEntryNotFoundError(f"config.json not in {folder}")
            return folder
        parts = gguf_parts(files, repo_id, tag=tag, gguf_file=gguf_file)
        folder = _download(repo_id, revision, parts)
        if not all(os.path.isfile(os.path.join(folder, part)) for part in parts):
            # offline, huggingface_hub hands back the cached snapshot without checking it holds these files
            raise LocalEntryNotFoundError(f"{parts} not in {folder}")
        return os.path.join(folder, parts[0])
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        raise ValueError(_not_cached_message(model, revision)) from e
    except GatedRepoError as e:
        raise ValueError(f"{repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN "
                         "(or run `hf auth login`)") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"no Hugging Face repo {repo_id!r} (or it is private: set HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"{repo_id} has no revision {revision!r}") from e
    except HfHubHTTPError as e:  # the hub answered with another error (rate limit, server error)
        raise ValueError(f"fetching {repo_id} from the Hugging Face hub failed: {e}") from e


def resolve_tokenizer_repo(repo_id: str, *, revision: str | None = None) -> str:
    """The snapshot folder of repo ``repo_id``'s tokenizer files (no weights), downloaded if need be."""
    patterns = [p for p in FOLDER_PATTERNS if "safetensors" not in p]
    try:
        validate_repo_id(repo_id)
        return _download(repo_id, revision, patterns)
    except HFValidationError as e:
        raise ValueError(f"tokenizer {repo_id!r} is neither a local path nor a valid Hugging Face repo id: {e}") from e
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        raise ValueError(_not_cached_message(repo_id, revision)) from e
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, HfHubHTTPError) as e:
        raise ValueError(f"tokenizer {repo_id!r} at revision {revision!r}: {e}") from e


def _not_cached_message(model: str, revision: str | None) -> str:
    rev = f" at revision {revision!r}" if revision else ""
    repo_id = model.split(":")[0]
    # `hf` is huggingface_hub's command since 1.0; `huggingface-cli` before
    download = f"download it first with `hf download {repo_id}` (`huggingface-cli download {repo_id}`)"
    local = "or pass a local path (a .gguf file or a folder with config.json)"
    where = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        return (f"model {model!r}{rev} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE is set: "
                f"set HF_HUB_OFFLINE=0 to download it, {download}, {local}")
    return (f"model {model!r}{rev} is not in the Hugging Face cache ({where}) and could not be downloaded "
            f"(no connection to the hub?): {download}, {local}")


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """The repo's file names: asked of the hub, or read off the cached snapshot when offline or unreachable."""
    if not constants.HF_HUB_OFFLINE:
        try:
            # model_info, not list_repo_files: the listing retries a failed connection for ~30 s
            info = HfApi().model_info(repo_id, revision=revision)
            return sorted(sibling.rfilename for sibling in info.siblings or ())
        except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError):
            raise
        except Exception:  # noqa: BLE001 (no connection, a proxy, a timeout: the cache may still have it)
            pass
    folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    return sorted(
        os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
        for root, _, names in os.walk(folder) for name in names
    )


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    """Fetch the files matching ``patterns`` (what the cache lacks) and return the snapshot folder."""
    folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    return str(folder)


def gguf_parts(files: list[str], repo_id: str, *, tag: str | None, gguf_file: str | None) -> list[str]:
    """The files of the one GGUF model picked among ``files``: itself, or its split parts in order.

    ``gguf_file`` names it (a file, or any part of a split one); ``tag`` picks
    the model whose file name carries it (``Q4_K_M`` in ``model-Q4_K_M.gguf``,
    case-insensitive); with neither, the repo's one model, or its Q4_K_M.
    """
    models = _gguf_models(files)
    if not models:
        folder = "config.json" in files
        raise ValueError(f"{repo_id} has no .gguf file" + (" to pick with a tag or gguf_file: name it as org/repo"
                         if folder else " nor config.json: not a model pagedllm loads"))
    if gguf_file is not None:
        picked = [parts for parts in models if gguf_file in parts or _basenames(parts, gguf_file)]
        if not picked:
            raise ValueError(f"{repo_id} has no GGUF file {gguf_file!r}; it has: {_listing(models)}")
        return picked[0]
    wanted = tag if tag is not None else DEFAULT_GGUF_TAG
    picked = [parts for parts in models if _has_tag(parts[0], wanted)]
    if tag is None and not picked and len(models) == 1:
        return models[0]
    if len(picked) == 1:
        return picked[0]
    how = f"the tag {tag!r} matches {len(picked)} of its" if tag is not None else "it has several"
    raise ValueError(f"{repo_id}: {how} GGUF files; name one as {repo_id}:QUANT or with --gguf-file: "
                     f"{_listing(models)}")


def _gguf_models(files: list[str]) -> list[list[str]]:
    """The GGUF models among ``files``, each as its list of files (one, or the split parts in order)."""
    models: list[list[str]] = []
    for name in sorted(files):
        base = os.path.basename(name)
        if not base.endswith(".gguf") or base.startswith("mmproj"):  # vision projectors are not language models
            continue
        split = SPLIT_RE.match(name)
        if split is None:
            models.append([name])
        elif int(split["no"]) == 1:
            count = int(split["count"])
            models.append([f"{split['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)])
    return models


def _basenames(parts: list[str], name: str) -> bool:
    return any(os.path.basename(p) == name for p in parts)


def _has_tag(name: str, tag: str) -> bool:
    """Whether ``tag`` is one of the file name's ``-``/``.``/``_``-separated runs (case-insensitive)."""
    split = SPLIT_RE.match(name)
    stem = split["prefix"] if split is not None else name.removesuffix(".gguf")
    # "_" may precede a tag but not follow it: Q4_K is not a tag of model-Q4_K_M.gguf
    pattern = rf"(^|[-._/]){re.escape(tag.lower())}($|[-.])"
    return re.search(pattern, stem.lower()) is not None


def _listing(models: list[list[str]]) -> str:
    return ", ".join(parts[0] + (f" (+{len(parts) - 1} parts)" if len(parts) > 1 else "") for parts in models)
