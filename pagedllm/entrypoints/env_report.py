"""``pagedllm env``: what this machine gives the engine, for bug reports.

The CPU's model and the SIMD features the kernels look for, torch's build and
what its CPU backends can do here, the native kernels (ISA variant, whether the library is a wheel's prebuilt one
or built here, C++ compiler, flags, where the built library is cached, or why it did not build) and which backend each
kind of layer runs on: what ``"auto"`` resolves to, and with ``--load`` the
classes a loaded model actually holds. With ``--model`` (or ``--load``), the model's own defaults: the
sampling its ``generation_config.json`` (or GGUF metadata) sets and the tokens that end generation.
"""

from __future__ import annotations

import json
import platform
import subprocess
from collections import Counter
from typing import Any

# the features the kernels (or torch's kernels they are measured against) use
CPU_FEATURES = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> dict[str, Any]:
    from pagedllm.kernels import compiler_path

    path = compiler_path()
    if path is None:
        return {"path": None, "version": None}
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        version = f"unknown ({e})"
    return {"path": path, "version": version.splitlines()[0] if version else None}


def _kernels() -> dict[str, Any]:
    from pagedllm import kernels

    lib = kernels.load_kernels()
    out: dict[str, Any] = {
        "isa": kernels.kernel_isa(),
        "default_isa": kernels.default_isa(),
        "runnable_isas": kernels.runnable_isas(),
        "loaded": lib is not None,
        # the variant loaded and where it came from: a wheel's prebuilt library, or built here (JIT)
        "variant": kernels.loaded_variant(),
        "prebuilt": kernels.kernels_prebuilt(),
        "source": ("prebuilt" if kernels.kernels_prebuilt() else "built here (JIT)") if lib is not None else None,
        "prebuilt_variants": list(kernels.prebuilt_libraries()),
        "prebuilt_torch": (kernels.prebuilt_info() or {}).get("torch"),
        "prebuilt_refused": kernels.prebuilt_refused(),
        "failure": kernels.kernels_failure(),
        "cflags": " ".join(kernels.build_flags()),
        "cache_dir": str(kernels.cache_dir()),
        "compiler": _compiler(),
    }
    if lib is not None:
        from pagedllm.layers.quantization.packed_linear import packed_linear_bf16_isa

        out["bf16_linear_isa"] = packed_linear_bf16_isa()
        out["library"] = kernels.library_path()
    return out


def _auto_backends() -> dict[str, Any]:
    """What "auto" picks here for float32 and bfloat16 on the CPU (no model needed): ``resolve_config``'s
    choices for a config of each dtype, not a derivation of its own."""
    from pagedllm.config import EngineConfig
    from pagedllm.kernels import load_kernels
    from pagedllm.resolved_config import resolve_config

    native = load_kernels() is not None
    # the model is not read to resolve the backends: any path names the config
    f32 = resolve_config(EngineConfig(model="(none)", dtype="float32"))
    bf16 = resolve_config(EngineConfig(model="(none)", dtype="bfloat16"))
    f32_linear = f32.linear_backend
    bf16_linear = bf16.linear_backend if bf16.linear_backend != "torch" else "torch (slow: no bf16 kernel for this CPU)"
    return {
        "float32": {"linear": f32_linear, "attention": f32.attention_backend, "batch_invariant": f32.batch_invariant,
                    "norms_rope_silu": "native" if native else "torch", "captured_decode": native,
                    "step_programs": native},
        "bfloat16": {"linear": bf16_linear, "attention": bf16.attention_backend, "batch_invariant": bf16.batch_invariant,
                     "captured_decode": native, "step_programs": native},
        "int8": {"linear": "int8 blocks" if native else "refused (no kernels)", "captured_decode": native,
                 "step_programs": native},
        "int4": {"linear": "int4 blocks" if native else "refused (no kernels)", "captured_decode": native,
                 "step_programs": native},
    }


def _kv_pool_report(runner: Any) -> dict[str, Any]:
    """The loaded engine's KV pool and ``max_model_len``, and where each came from."""
    plan = runner.kv_pool
    budget = "num_kv_blocks" if plan.budget_bytes is None else f"{plan.budget_bytes / 2**30:.2f} GiB"
    return {
        "max_model_len": plan.max_model_len,
        "max_model_len_source": (f"lowered from {plan.requested_max_model_len} to fit the KV cache"
                                 if plan.lowered else "as requested (or the model's context)"),
        "num_kv_blocks": plan.num_kv_blocks,
        "kv_cache_reserved_gib": round(runner.kv_cache_bytes / 2**30, 3),
        "kv_cache_budget": budget,
    }


def _memory() -> dict[str, Any]:
    """The memory free here and the default KV pool's share of it (``resolved_config.default_kv_budget``)."""
    import torch

    from pagedllm.device_memory import available_memory_bytes
    from pagedllm.resolved_config import DEFAULT_KV_SHARE

    available = available_memory_bytes(torch.device("cpu"))
    return {
        "available_gib": round(available / 2**30, 2),
        "default_kv_pool": f"{DEFAULT_KV_SHARE:g} of what the weights leave of the available memory "
                           "(reserved; resident only where written)",
        "max_model_len_default": "the model's context, lowered to what the KV pool holds (--max-model-len, "
                                 "--kv-cache-memory-bytes to choose)",
    }


def loaded_model_report(llm: Any) -> dict[str, Any]:
    """The layer classes and backends a loaded ``LLM`` runs."""
    from pagedllm.layers.kv_quant import kv_format_name

    runner = llm.llm_engine.model_runner
    layers = Counter(type(m).__name__ for m in runner.model.modules() if not list(m.children()))
    return {
        "model": llm.llm_engine.config.model,
        "dtype": llm.llm_engine.config.dtype,
        "linear_backend": runner.linear_backend,
        "attention_backend": runner.backend.name,
        "native_ops": runner.native_ops is not None,
        "captured_decode": runner.captured_decode is not None,
        # replayed decode steps run their kernels as native step programs (runner/capture/step_program.py)
        "step_programs": runner.captured_decode is not None and runner.captured_decode.native_programs,
        "kv_cache_dtype": kv_format_name(runner.kv_cache.dtype),
        # one block across all layers, K and V (an int8 / int4 cache's scales included)
        "kv_bytes_per_block": runner.kv_bytes_per_block,
        "batch_invariant": llm.llm_engine.resolved_config.batch_invariant,
        "sampling_defaults": llm.llm_engine.generation_defaults.report(),
        "end_token_ids": ", ".join(map(str, sorted(llm.llm_engine.tokenizer.eos_token_ids))),
        # the pool and the context resolved for this machine's memory (resolved_config.plan_kv_pool)
        **_kv_pool_report(runner),
        "layer_classes": dict(sorted(layers.items())),
    }


def model_defaults_report(model: str | None, generation_config: str = "auto") -> dict[str, Any]:
    """What the model brings besides its weights, read without loading them: the sampling defaults that
    ``generation_config`` selects (and where they came from) and the tokens that end generation."""
    from pagedllm.loader import load_model_config, resolve_model_path
    from pagedllm.loader.generation_defaults import load_generation_defaults

    path = resolve_model_path(model)
    end_ids = load_model_config(path).eos_token_ids
    return {
        "model": path,
        "generation_config": generation_config,
        "sampling_defaults": load_generation_defaults(path, generation_config).report(),
        # with the tokenizer's own EOS, which the engine adds (loader/tokenizer.py)
        "end_token_ids": ", ".join(map(str, end_ids)) or "the tokenizer's EOS only",
    }


def collect() -> dict[str, Any]:
    """Everything ``pagedllm env`` prints, as plain data."""
    import torch

    from pagedllm import __version__
    from pagedllm.kernels import cpu_flags
    from pagedllm.layers.quantization.onednn_linear import onednn_bf16_supported

    flags = cpu_flags()
    return {
        "pagedllm": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": _cpu_model(), "machine": platform.machine(),
                "features": [f for f in CPU_FEATURES if f in flags]},
        "torch": {
            "version": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "num_threads": torch.get_num_threads(),
            "onednn": torch.backends.mkldnn.is_available(),
            "onednn_bf16": onednn_bf16_supported(),
            "cuda": torch.cuda.is_available(),
        },
        "kernels": _kernels(),
        "memory": _memory(),
        "auto": _auto_backends(),
        # EngineConfig.batch_invariant's default ("auto": on wherever the kernels allow), docs/batch-invariance.md
        "batch_invariant": {"default": "auto", "flag": "--batch-invariant / --no-batch-invariant"},
    }


def format_report(report: dict[str, Any], indent: int = 0) -> str:
    """The report as indented ``key: value`` lines."""
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(format_report(value, indent + 2))
        else:
            shown = ", ".join(value) if isinstance(value, list) else value
            lines.append(" " * indent + f"{key}: {shown}")
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
