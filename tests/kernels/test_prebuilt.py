"""Choosing a wheel's prebuilt kernel library: the best variant a CPU runs, refused when built for another torch.

Pure functions over feature sets and records (no build, no wheel): the wheel
itself is built, installed and run without a compiler in tests/e2e/test_packaging.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm import kernels
from pagedllm.kernels.variants import PREBUILT_ISAS, pick_prebuilt, prebuilt_mismatch

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "movbe"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
AVX512_BF16 = AVX512 | {"avx512_bf16", "avx512_vnni"}
ALL = list(PREBUILT_ISAS)


@pytest.mark.parametrize(("features", "available", "expected"), [
    (AVX512_BF16, ALL, "avx512_bf16"),
    (AVX512, ALL, "avx512"),
    (AVX512 | {"avx512_vnni"}, ALL, "avx512"),  # VNNI without BF16: not the bf16 variant
    (AVX2, ALL, "avx2"),
    (AVX2 - {"fma"}, ALL, "scalar"),  # AVX2 without FMA (some VIA / early parts): x86-64-v3 needs both
    (set(), ALL, "scalar"),
    (AVX512_BF16, ["avx2", "scalar"], "avx2"),  # a wheel without the AVX-512 variants
    (AVX512_BF16, ["scalar", "avx512"], "avx512"),  # the order given does not matter
    (AVX2, ["avx512", "avx512_bf16"], None),  # nothing this CPU runs
    (AVX2, [], None),
])
def test_the_best_prebuilt_variant_the_cpu_runs_is_picked(features, available, expected) -> None:  # noqa: ANN001
    assert pick_prebuilt(frozenset(features), available) == expected


def test_no_prebuilt_variant_off_x86_64() -> None:
    assert pick_prebuilt({"fp", "asimd", "sve"}, ALL, machine="aarch64") is None


def test_a_record_of_another_torch_is_refused_with_the_versions_named() -> None:
    info = {"torch": "2.12.0+cpu", "variants": ALL, "sources": "abc"}
    why = prebuilt_mismatch(info, "2.13.0+cpu", "abc")
    assert why == ("the prebuilt kernels were built against torch 2.12.0+cpu, this is torch 2.13.0+cpu "
                   "(reinstall pagedllm for this torch, or build them here)")
    assert prebuilt_mismatch(info | {"torch": "2.13.0+cpu"}, "2.13.0+cpu", "abc") is None
    assert "other sources" in prebuilt_mismatch(info | {"torch": "2.13.0+cpu"}, "2.13.0+cpu", "def")
    assert prebuilt_mismatch(info | {"torch": "2.13.0+cpu"}, "2.13.0+cpu", None) is None  # no sources to compare


def _fake_wheel(tmp_path: Path, variants: list[str], torch_version: str) -> Path:
    d = tmp_path / "_prebuilt"
    d.mkdir()
    for isa in variants:
        (d / f"pagedllm_kernels_{isa}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (d / "build_info.json").write_text(json.dumps({"torch": torch_version, "variants": variants, "sources": "s"}))
    return d


def test_choose_prebuilt_from_a_wheels_folder(tmp_path: Path) -> None:
    d = _fake_wheel(tmp_path, ["avx512_bf16", "avx512", "avx2", "scalar"], "2.13.0+cpu")
    libs = kernels.prebuilt_libraries(d)
    # "avx512" does not also find "avx512_bf16"'s library
    assert {k: v.name for k, v in libs.items()} == {
        isa: f"pagedllm_kernels_{isa}.cpython-311-x86_64-linux-gnu.so" for isa in PREBUILT_ISAS}
    info = kernels.prebuilt_info(d)

    def choose(isa, version="2.13.0+cpu", features=AVX2, available=libs):  # noqa: ANN001, ANN202
        return kernels.choose_prebuilt(isa, available, info, version, "s", frozenset(features), "x86_64")

    assert choose(None) == ("avx2", None)
    assert choose(None, features=AVX512_BF16) == ("avx512_bf16", None)
    assert choose("scalar") == ("scalar", None)  # PAGEDLLM_KERNEL_ISA forces a prebuilt variant
    assert choose("native") == (None, None)  # never prebuilt: built here
    chosen, why = choose(None, version="2.14.0+cpu")
    assert chosen is None and "built against torch 2.13.0+cpu, this is torch 2.14.0+cpu" in why
    assert kernels.choose_prebuilt(None, libs, None, "2.13.0+cpu", "s", frozenset(AVX2), "x86_64") == (
        None, "the prebuilt kernels have no build_info.json (the torch they were built against is unknown)")
    assert kernels.choose_prebuilt(None, {}, None, "2.13.0+cpu", "s", frozenset(AVX2), "x86_64") == (None, None)
    # a library the record does not list (left in an in-tree build folder by an earlier build) is not used
    assert choose(None, available=libs) == ("avx2", None)
    info["variants"] = ["scalar"]
    assert choose(None) == ("scalar", None)


def test_a_checkout_builds_the_kernels_here() -> None:
    """No _prebuilt folder in a checkout or an editable install: the loaded library is a JIT build."""
    if kernels.prebuilt_libraries():
        pytest.skip("this checkout holds prebuilt kernels (an in-place build)")
    if kernels.load_kernels() is None:
        pytest.skip(f"no native kernels here: {kernels.kernels_failure()}")
    assert kernels.kernels_prebuilt() is False and kernels.loaded_variant() == kernels.kernel_isa()


def test_env_reports_the_variant_and_whether_it_was_prebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.entrypoints import env_report

    real = kernels._load()
    if real.ops is None:
        pytest.skip(f"no native kernels here: {real.failure}")
    report = env_report._kernels()
    assert report["variant"] == real.variant and report["prebuilt"] == real.prebuilt
    assert report["source"] == ("prebuilt" if real.prebuilt else "built here (JIT)")
    fake = real._replace(prebuilt=True, path="/site/pagedllm/kernels/_prebuilt/pagedllm_kernels_avx2.so",
                         variant="avx2")
    monkeypatch.setattr(kernels, "_load", lambda: fake)
    report = env_report._kernels()
    assert (report["variant"], report["prebuilt"], report["source"]) == ("avx2", True, "prebuilt")
    assert report["library"] == fake.path
    refused = real._replace(prebuilt=False, prebuilt_refused="the prebuilt kernels were built against torch 2.12.0")
    monkeypatch.setattr(kernels, "_load", lambda: refused)
    report = env_report._kernels()
    assert report["source"] == "built here (JIT)" and "2.12.0" in report["prebuilt_refused"]
