"""Models named by Hugging Face repo id, resolved from a cache the tests lay out (no network).

Each test writes a ``huggingface_hub`` cache (``models--org--repo/{blobs,
refs,snapshots}``) in a tmp folder, points ``HF_HUB_CACHE`` at it and sets
``HF_HUB_OFFLINE=1``: what ``huggingface-cli download`` would have left there.
Blobs are links to the bundled GGUF and the tiny folders' files, not copies.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants

from pagedllm import LLM, SamplingParams
from pagedllm.loader import gguf_loader, hub, resolve_model_path
from pagedllm.loader.gguf_split import split_part_paths

ENGINE = {"num_kv_blocks": 64, "max_model_len": 256, "num_threads": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPT = "The capital of France is"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, offline: huggingface_hub reads its constants once, at import, so both
    the environment (for subprocesses) and the constants are set."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def lay_out_repo(cache: Path, repo_id: str, files: dict[str, str], ref: str = "main",
                 commit: str | None = None) -> Path:
    """Put ``files`` (name in the repo -> a local file) in ``cache`` as huggingface_hub stores a download of
    ``repo_id`` at ``ref``; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    (repo / "blobs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        if not blob.exists():
            blob.symlink_to(os.path.abspath(source))
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    return snapshot


def folder_files(folder: str) -> dict[str, str]:
    return {name: os.path.join(folder, name) for name in os.listdir(folder)}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    from conftest import save_tiny_models

    return save_tiny_models(("llama",), tmp_path_factory, smollm_tokenizer)["llama"]


def greedy_ids(model: str, **kwargs: object) -> list[int]:
    with LLM(model, **ENGINE, **kwargs) as llm:
        return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


# --- Hugging Face folder repos -------------------------------------------------------


def test_folder_repo_resolves_to_its_snapshot_and_generates_as_the_folder(hub_cache: Path, tiny_llama: str) -> None:
    snapshot = lay_out_repo(hub_cache, "org/tiny-llama", folder_files(tiny_llama))
    assert resolve_model_path("org/tiny-llama") == str(snapshot)
    assert greedy_ids("org/tiny-llama") == greedy_ids(tiny_llama)


def test_revision_picks_its_snapshot(hub_cache: Path, tiny_llama: str, tmp_path: Path) -> None:
    main = lay_out_repo(hub_cache, "org/tiny-llama", folder_files(tiny_llama))
    v2 = lay_out_repo(hub_cache, "org/tiny-llama", folder_files(tiny_llama), ref="v2", commit="b" * 40)
    assert main != v2
    assert resolve_model_path("org/tiny-llama") == str(main)
    assert resolve_model_path("org/tiny-llama", revision="v2") == str(v2)
    assert resolve_model_path("org/tiny-llama", revision="b" * 40) == str(v2)  # a commit names its snapshot
    with pytest.raises(ValueError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE=0"):
        resolve_model_path("org/tiny-llama", revision="v3")


def test_folder_repo_downloads_only_what_the_engine_reads(hub_cache: Path, tiny_llama: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from fnmatch import fnmatch

    lay_out_repo(hub_cache, "org/tiny-llama", folder_files(tiny_llama))
    asked = []
    real = hub.snapshot_download
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: asked.append(k.get("allow_patterns")) or real(*a, **k))
    resolve_model_path("org/tiny-llama")
    patterns = asked[-1]

    def fetched(name: str) -> bool:
        return any(fnmatch(name, p) for p in patterns)

    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                 "chat_template.jinja", "special_tokens_map.json"):
        assert fetched(name), name
    for name in ("pytorch_model.bin", "model.Q4_K_M.gguf", "original/consolidated.00.pth", "README.md",
                 "onnx/model.onnx"):
        assert not fetched(name), name


def test_local_path_wins_over_a_repo_id(hub_cache: Path, tiny_llama: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    lay_out_repo(hub_cache, "org/tiny-llama", folder_files(tiny_llama))
    local = tmp_path / "work" / "org" / "tiny-llama"
    local.mkdir(parents=True)
    (local / "config.json").write_text(Path(tiny_llama, "config.json").read_text())
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_path("org/tiny-llama") == str(local)


# --- GGUF repos ----------------------------------------------------------------------


def test_quant_tag_picks_one_gguf_among_several(hub_cache: Path, smollm_path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["README.md", "model-Q4_0.gguf", "model-Q4_K_M.gguf", "model-Q4_K_S.gguf", "model-Q8_0.gguf",
             "mmproj-model-f16.gguf"]
    snapshot = lay_out_repo(hub_cache, "org/smol-GGUF", {n: smollm_path for n in names})
    asked = []
    real = hub.snapshot_download
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: asked.append(k.get("allow_patterns")) or real(*a, **k))
    assert resolve_model_path("org/smol-GGUF:Q8_0") == str(snapshot / "model-Q8_0.gguf")
    assert asked[-1] == ["model-Q8_0.gguf"]  # only the file named is fetched
    assert resolve_model_path("org/smol-GGUF:q4_k_s") == str(snapshot / "model-Q4_K_S.gguf")  # any case
    assert resolve_model_path("org/smol-GGUF") == str(snapshot / "model-Q4_K_M.gguf")  # llama.cpp's default
    assert resolve_model_path("org/smol-GGUF", gguf_file="model-Q4_0.gguf") == str(snapshot / "model-Q4_0.gguf")
    with pytest.raises(ValueError, match=r"tag 'Q5_K_M' matches 0 of its GGUF files.*model-Q4_0\.gguf"):
        resolve_model_path("org/smol-GGUF:Q5_K_M")
    with pytest.raises(ValueError, match="no GGUF file 'model-Q2_K.gguf'"):
        resolve_model_path("org/smol-GGUF", gguf_file="model-Q2_K.gguf")


def test_quant_tag_repo_generates_as_the_file(hub_cache: Path, smollm_path: str) -> None:
    lay_out_repo(hub_cache, "org/smol-GGUF", {"smol.Q4_1.gguf": smollm_path, "smol.Q8_0.gguf": smollm_path})
    assert greedy_ids("org/smol-GGUF:Q4_1") == greedy_ids(smollm_path)


def write_split_gguf(source: str, out_dir: Path, stem: str, tensors_per_part: int) -> list[Path]:
    """``source`` rewritten as gguf-split does: parts with split.no/split.count/split.tensors.count, the model's
    metadata in the first, the tensors (bytes as stored) shared among them."""
    from gguf import GGUFValueType, GGUFWriter

    reader = gguf_loader.open_reader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out_dir / f"{stem}.gguf", arch, split_max_tensors=tensors_per_part)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out_dir.glob(f"{stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def split_gguf(tmp_path_factory: pytest.TempPathFactory, smollm_path: str) -> list[Path]:
    return write_split_gguf(smollm_path, tmp_path_factory.mktemp("split"), "smol-Q4_1", tensors_per_part=100)


def test_split_gguf_loads_as_one_model(split_gguf: list[Path], smollm_path: str) -> None:
    num_tensors = len(gguf_loader.open_reader(smollm_path).tensors)
    assert [p.name for p in split_gguf] == [f"smol-Q4_1-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert gguf_loader.model_part_paths(str(split_gguf[0])) == [str(p) for p in split_gguf]
    assert sum(len(gguf_loader.open_reader(str(p)).tensors) for p in split_gguf) == num_tensors
    assert greedy_ids(str(split_gguf[0])) == greedy_ids(smollm_path)


def test_split_gguf_part_errors(split_gguf: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="part 2 of a model split in 3 files"):
        split_part_paths(str(split_gguf[1]), {"split.count": 3, "split.no": 1})
    lone = tmp_path / split_gguf[0].name
    lone.symlink_to(split_gguf[0])
    with pytest.raises(ValueError, match="missing beside it: smol-Q4_1-00002-of-00003.gguf"):
        gguf_loader.model_part_paths(str(lone))


def test_split_gguf_repo_fetches_every_part(hub_cache: Path, split_gguf: list[Path], smollm_path: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    files = {f"Q4_1/{p.name}": str(p) for p in split_gguf} | {"smol-Q8_0.gguf": smollm_path}
    snapshot = lay_out_repo(hub_cache, "org/smol-split-GGUF", files)
    asked = []
    real = hub.snapshot_download
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: asked.append(k.get("allow_patterns")) or real(*a, **k))
    assert resolve_model_path("org/smol-split-GGUF:Q4_1") == str(snapshot / "Q4_1" / split_gguf[0].name)
    assert asked[-1] == [f"Q4_1/{p.name}" for p in split_gguf]


# --- errors --------------------------------------------------------------------------


def test_nothing_cached_offline_is_one_clear_error(hub_cache: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model_path("org/not-downloaded")
    message = str(info.value)
    for hint in ("org/not-downloaded", "HF_HUB_OFFLINE=0", "hf download org/not-downloaded",
                 "local path", str(hub_cache)):
        assert hint in message, message


@pytest.mark.parametrize("name", ["not a repo", "org/re po", "a/b/c/d", "org/repo:Q4:K", "./missing-folder",
                                  "missing.gguf", "org/--bad--"])
def test_name_that_is_no_path_nor_repo_id_is_refused(hub_cache: Path, name: str) -> None:
    with pytest.raises(ValueError, match="neither a local path"):
        resolve_model_path(name)


def test_tag_and_gguf_file_together_are_refused(hub_cache: Path, smollm_path: str) -> None:
    lay_out_repo(hub_cache, "org/smol-GGUF", {"smol.Q4_1.gguf": smollm_path})
    with pytest.raises(ValueError, match="give one"):
        resolve_model_path("org/smol-GGUF:Q4_1", gguf_file="smol.Q4_1.gguf")


def test_repo_options_with_a_local_model_are_refused_not_ignored(smollm_path: str, tiny_llama: str) -> None:
    with pytest.raises(ValueError, match="revision='v1' applies to a Hugging Face repo id"):
        resolve_model_path(smollm_path, revision="v1")
    with pytest.raises(ValueError, match="revision='v1' applies to a Hugging Face repo id"):
        resolve_model_path(tiny_llama, revision="v1")
    with pytest.raises(ValueError, match="the bundled model is a local path"):
        resolve_model_path(None, revision="v1")
    with pytest.raises(ValueError, match="is one file already"):
        resolve_model_path(smollm_path, gguf_file="other.gguf")
    with pytest.raises(ValueError, match="is one file already"):
        resolve_model_path(None, gguf_file="other.gguf")


# --- the command line ----------------------------------------------------------------


def run_generate(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", PROMPT, "--temperature", "0",
               "--max-tokens", "4", "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ))


@pytest.mark.slow
def test_cli_generate_model_by_repo_id(hub_cache: Path, smollm_path: str) -> None:
    lay_out_repo(hub_cache, "org/smol-GGUF", {"smol.Q4_1.gguf": smollm_path, "smol.Q8_0.gguf": smollm_path})
    by_id = run_generate("--model", "org/smol-GGUF", "--gguf-file", "smol.Q4_1.gguf")
    by_path = run_generate("--model", smollm_path)
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout.splitlines()[:2] == by_path.stdout.splitlines()[:2]

    missing = run_generate("--model", "org/not-downloaded")
    assert missing.returncode != 0
    assert "Traceback" not in missing.stderr, missing.stderr
    assert "HF_HUB_OFFLINE=0" in missing.stderr


def test_served_name_is_the_repo_id(tmp_path: Path) -> None:
    from pagedllm.entrypoints.cli import _served_name

    assert _served_name("org/smol-GGUF:Q4_1", "/cache/models--org--smol-GGUF/snapshots/abc/smol.Q4_1.gguf") \
        == "org/smol-GGUF:Q4_1"
    local = tmp_path / "smol.gguf"
    local.write_bytes(b"")
    assert _served_name(str(local), str(local)) == "smol.gguf"
    assert _served_name(None, str(local)) == "smol.gguf"


def test_tokenizer_by_repo_id_and_revision(hub_cache: Path, tiny_llama: str, smollm_path: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.engine.llm import make_engine_config

    main = lay_out_repo(hub_cache, "org/tiny-llama", folder_files(tiny_llama))
    v2 = lay_out_repo(hub_cache, "org/tiny-llama", folder_files(tiny_llama), ref="v2", commit="c" * 40)
    asked = []
    real = hub.snapshot_download
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: asked.append(k.get("allow_patterns")) or real(*a, **k))
    assert make_engine_config(smollm_path, tokenizer="org/tiny-llama").tokenizer == str(main)
    assert not any("safetensors" in p for p in asked[-1])  # a tokenizer's files, not the weights
    config = make_engine_config(smollm_path, tokenizer="org/tiny-llama", tokenizer_revision="v2")
    assert (config.tokenizer, config.tokenizer_revision) == (str(v2), "v2")
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        make_engine_config(smollm_path, tokenizer="org/no-tokenizer")


def test_serve_repo_id_loads_the_snapshot_and_serves_the_id(hub_cache: Path, smollm_path: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``pagedllm serve org/repo:QUANT`` (positional): the engine loads the cached file, /v1/models names the id."""
    from pagedllm.entrypoints import cli
    from pagedllm.entrypoints.openai import api_server

    snapshot = lay_out_repo(hub_cache, "org/smol-GGUF", {"smol.Q4_1.gguf": smollm_path, "smol.Q8_0.gguf": smollm_path})
    served = {}

    def fake_run_server(engine, settings) -> None:  # noqa: ANN001 (stands in for the HTTP server)
        served.update(model=engine.config.model, name=settings.model_name, path=settings.model_path)

    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    monkeypatch.setattr(cli, "check_port_free", lambda host, port: None)
    status = cli.main(["serve", "org/smol-GGUF:q4_1", "--num-kv-blocks", "64", "--max-model-len", "256",
                       "--num-threads", "1"])
    assert status == 0
    assert served == {"model": str(snapshot / "smol.Q4_1.gguf"), "name": "org/smol-GGUF:q4_1",
                      "path": str(snapshot / "smol.Q4_1.gguf")}


def test_tag_on_a_folder_repo_and_a_repo_with_no_model(hub_cache: Path, tiny_llama: str, tmp_path: Path) -> None:
    lay_out_repo(hub_cache, "org/tiny-llama", folder_files(tiny_llama))
    with pytest.raises(ValueError, match="no .gguf file to pick with a tag"):
        resolve_model_path("org/tiny-llama:Q4_K_M")
    readme = tmp_path / "README.md"
    readme.write_text("no model here")
    lay_out_repo(hub_cache, "org/empty", {"README.md": str(readme)})
    with pytest.raises(ValueError, match="no .gguf file nor config.json"):
        resolve_model_path("org/empty")
