"""Configuration records (``config_record.py``) and the one resolver of "auto" (``resolved_config.py``).

Records: strict pydantic validation, one-line ValueErrors naming the field, docstrings read per field.
Resolver: the only module that reads an unresolved "auto" (an AST scan of the package), and its record
holds none.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import pagedllm
from pagedllm.config import EngineConfig
from pagedllm.config_record import ConfigError, field_docs
from pagedllm.resolved_config import ResolvedConfig, resolve_config
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.structured_output.limits import GrammarLimits

ROOT = Path(pagedllm.__file__).parent


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_size": 0}, "block_size must be a positive integer, got 0"),
    ({"block_size": 16.0}, "block_size must be an integer, got 16.0"),  # strict: no silent rounding
    ({"block_size": True}, "block_size must be an integer, got True"),
    ({"block_size": "16"}, "block_size must be an integer, got '16'"),
    ({"distributed_timeout_s": 0}, "distributed_timeout_s must be a positive number, got 0"),
    ({"capture_min_decode_steps": -1}, "capture_min_decode_steps must be an integer >= 0, got -1"),
    ({"dtype": "fp64"}, "dtype must be one of 'float32', 'bfloat16' or 'float16', got 'fp64'"),
    ({"enforce_eager": "yes"}, "enforce_eager must be true or false, got 'yes'"),
    ({"model": ""}, "model must be a non-empty string, got ''"),
    ({"typo": 1}, "EngineConfig has no field 'typo'"),
    ({"grammar_limits": {"max_bytes": 1}}, "grammar_limits must be a GrammarLimits"),
    ({"speculative_config": {"method": "nope"}}, "speculative_config: unknown speculative method 'nope'"),
])
def test_a_refused_value_is_one_line_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{"model": "m", **kwargs})
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value) and "pydantic" not in str(info.value)


def test_nested_records_name_their_engine_field() -> None:
    with pytest.raises(ValueError, match=r"^grammar_limits\.max_depth must be a positive integer, got 0$"):
        GrammarLimits(max_depth=0)
    with pytest.raises(ValueError, match=r"^speculative_config\.num_speculative_tokens must be a positive integer"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="header_timeout_s must be a positive number, got 0"):
        from pagedllm.entrypoints.openai.http_protocol import HTTPLimits

        HTTPLimits(0)  # positional: named by its field all the same


def test_records_are_frozen_and_keep_their_constructors() -> None:
    config = EngineConfig(model="m", block_size=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8  # type: ignore[misc]
    assert dataclasses.replace(config, block_size=8).block_size == 8
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(config, block_size=0)
    assert EngineConfig(model="m", speculative_config='{"method": "ngram"}').speculative_config == SpeculativeConfig()


def test_field_docs_read_the_args_section() -> None:
    docs = field_docs(EngineConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert docs["block_size"] == "token slots per KV block."
    assert docs["max_num_batched_tokens"].endswith("(chunked prefill).")  # continuation lines joined


# --- the resolver ---------------------------------------------------------------------------------

# EngineConfig's fields whose value may leave a choice to the engine
AUTO_FIELDS = {"attention_backend", "linear_backend", "distributed_executor_backend", "kv_cache_dtype",
               "itl_target_ms", "batch_invariant", "all_reduce_backend"}
AUTO_ARGUMENTS = AUTO_FIELDS | {"all_reduce"}
RESOLVER = ROOT / "resolved_config.py"
# config.py declares the fields and checks what a given value combines with (e.g. linear_backend left at
# "auto" under weight-only quantization): it validates the request, it takes no choice
DECLARES = ROOT / "config.py"


def _reads_of_auto(path: Path) -> list[str]:
    """``<x>.<auto field> ==/!=/in "auto"`` (or ``is None`` for batch_invariant) anywhere in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        fields = [s.attr for s in sides if isinstance(s, ast.Attribute) and s.attr in AUTO_FIELDS]
        # a field handed on as a plain argument keeps a shorter name (join_group's ``all_reduce``)
        fields += [s.id for s in sides if isinstance(s, ast.Name) and s.id in AUTO_ARGUMENTS]
        constants = [s.value for s in sides if isinstance(s, ast.Constant)]
        if fields and ("auto" in constants or (None in constants and "batch_invariant" in fields)):
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} reads {fields[0]}")
    return found


def test_no_module_but_the_resolver_reads_an_unresolved_auto() -> None:
    found = [hit for path in sorted(ROOT.rglob("*.py")) if path not in (RESOLVER, DECLARES)
             for hit in _reads_of_auto(path)]
    assert found == [], "resolve \"auto\" in resolved_config.py and read ResolvedConfig instead"
    assert _reads_of_auto(RESOLVER)  # the scan does see the resolver's own reads


def test_the_resolved_config_holds_no_auto() -> None:
    resolved = resolve_config(EngineConfig(model="m"))
    assert "auto" not in dataclasses.astuple(resolved)
    assert resolved.itl_auto and resolved.itl_target_ms is None
    for field in ("attention_backend", "linear_backend", "distributed_executor_backend", "all_reduce_backend"):
        with pytest.raises(ValueError, match=f"{field} must be one of"):
            dataclasses.replace(resolved, **{field: "auto"})
    with pytest.raises(ValueError, match="batch_invariant must be true or false"):
        dataclasses.replace(resolved, batch_invariant=None)
    assert isinstance(resolved, ResolvedConfig)


def test_the_resolver_takes_each_choice() -> None:
    assert resolve_config(EngineConfig(model="m", dtype="float16")).attention_backend == "sdpa"
    assert resolve_config(EngineConfig(model="m", device="cuda")).linear_backend == "torch"
    assert resolve_config(EngineConfig(model="m", quantization="int4")).linear_backend == "int4"
    assert resolve_config(EngineConfig(model="m", quantization="int4")).weight_group_size == 128
    assert resolve_config(EngineConfig(model="m", distributed_executor_backend="mp")).distributed_executor_backend == "mp"
    assert resolve_config(EngineConfig(model="m", itl_target_ms=25)).itl_target_ms == 25.0
    assert not resolve_config(EngineConfig(model="m", itl_target_ms=None)).itl_auto
    assert not resolve_config(EngineConfig(model="m", kv_allocator="contiguous")).prefix_caching
    # batch invariance: off where refused under "auto", a ValueError where asked for
    assert not resolve_config(EngineConfig(model="m", attention_backend="sdpa")).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant=True does not cover attention_backend='sdpa'"):
        resolve_config(EngineConfig(model="m", attention_backend="sdpa", batch_invariant=True))


def test_the_resolver_takes_the_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.kernels import kernels_available

    def resolved(**kwargs: object) -> str:
        return resolve_config(EngineConfig(model="m", **kwargs)).all_reduce_backend

    assert resolved() == "gloo"  # one rank sums nothing
    assert resolved(tensor_parallel_size=2, all_reduce_backend="gloo") == "gloo"
    # mp starts every rank on this machine: shared memory wherever the kernels load
    shm_here = "shm" if kernels_available() else "gloo"
    assert resolved(tensor_parallel_size=2, distributed_executor_backend="mp") == shm_here
    assert resolved(tensor_parallel_size=2, device="cuda") == "gloo"
    with pytest.raises(ValueError, match="all_reduce_backend='shm' needs device='cpu'"):
        resolved(tensor_parallel_size=2, device="cuda", all_reduce_backend="shm")
    # torchrun: on one machine only when all of its ranks are local
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolved(tensor_parallel_size=2, distributed_executor_backend="torchrun") == shm_here
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolved(tensor_parallel_size=4, distributed_executor_backend="torchrun") == "gloo"
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE \(2\) is not its WORLD_SIZE \(4\)"):
        resolved(tensor_parallel_size=4, distributed_executor_backend="torchrun", all_reduce_backend="shm")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # RANK / WORLD_SIZE set by hand: where the others run is unknown
    assert resolved(tensor_parallel_size=4, distributed_executor_backend="torchrun") == "gloo"
