"""Tensor parallelism for every family: two real ranks (gloo and shared memory, processes) against one process.

Each family's tiny checkpoint is the one its own tests make (``tests/models/test_family_*.py``'s fixtures),
run over two ranks with ``test_tensor_parallel.py``'s engines (one two-rank engine alive at a time, one
thread per rank, float32 activations and KV cache): greedy tokens equal one process's, and transformers'
where the folder is its model. What each family does its own way under the split:

- OLMo 2: q/k norms over the whole projection, so each rank holds its heads' slice of the norm weights and
  the ranks all-reduce each token's sum of squares (``ParallelRMSNorm``); decode steps replay from the
  captured graph, the all-reduce included.
- Phi-3: fused ``qkv_proj`` / ``gate_up_proj`` (a GGUF file's ``attn_qkv`` / ``ffn_up``) split by the
  whole model's rows, then each rank's q, k, v and gate, up rows taken; LongRoPE's short and long rows, a
  sliding window (Phi-3.5), a partial rotation and a tied head (Phi-4-mini).
- Gemma 2 / 3 (softcaps, alternating windows, head_dim 32 apart from hidden / heads), SmolLM3 (NoPE layers),
  Granite (multipliers), Llama 3 from a GGUF file with ``rope_freqs``.

Prompts run past the sliding windows and Phi-3's original context (32 positions), and one is short.
Each two-rank engine costs a process start and a load (seconds): one per checkpoint, several checks on it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from conftest import hf_greedy
from test_family_gemma import gemma_dirs  # noqa: F401 (a fixture)
from test_family_olmo2 import olmo2_dir  # noqa: F401 (a fixture)
from test_family_phi3 import phi3_dirs  # noqa: F401 (a fixture)
from test_family_smollm3_granite import smolgran_dirs  # noqa: F401 (a fixture)
from test_tensor_parallel import TwoRankEngines, _restore_threads, _tokens, _tp, two_ranks  # noqa: F401

from pagedllm import SamplingParams
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.kernels import load_kernels
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import NormSpec, RMSNorm
from pagedllm.layers.parallel import ParallelRMSNorm, parallel_norm_pair
from pagedllm.loader import load_model_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (41, 7)]


def _run(llm, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    return _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))


def _one_and_two(two_ranks: TwoRankEngines, path: str, prompts: list[list[int]]) -> tuple:  # noqa: F811
    """(one process's engine, its tokens, the two-rank engine, its tokens) of ``path``."""
    one = _tp(path, 1, block_size=8)
    expected = _run(one, prompts)
    two = two_ranks.shared(path, block_size=8)
    return one, expected, two, _run(two, prompts)


def _hf_tokens(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


# --- OLMo 2's norm over a split projection (one process, the ranks' all-reduce simulated) -------------------


class _PeerSum:
    """Stands in for a two-rank group: ``all_reduce_`` adds what the other rank's norm would contribute."""

    size = 2

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other  # [..., 1]: the other rank's sums of squares

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.other)


@pytest.mark.parametrize("spec", [NormSpec(1e-5), NormSpec(1e-6, unit_offset=True)])
def test_parallel_rms_norm_slices_equal_the_whole_norm(spec: NormSpec) -> None:
    """Two ranks' slices (40 and 24 of 64 features), each normed with the other's sum of squares added, are
    the whole norm's slices, in torch and native implementations, alone and as a q/k pair sharing one
    all-reduce; without the other's sum they are not."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen) * torch.linspace(0.1, 4.0, 64)
    whole = spec.build(64)
    with torch.no_grad():
        whole.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    want, want_doubled = whole(x).detach(), whole(2 * x).detach()
    lib = load_kernels()
    for start, dim in ((0, 40), (40, 24)):
        rest = torch.cat([x[:, :start], x[:, start + dim :]], dim=1)
        norm = ParallelRMSNorm(spec, dim, _PeerSum(rest.square().sum(-1, keepdim=True)), start, 64)
        with torch.no_grad():
            norm.weight.copy_(norm.checkpoint_slice("weight", whole.weight.detach()))
        for ops in (None, NativeOps(lib) if lib is not None else None):
            norm.select_impl(ops)
            with torch.no_grad():
                got = norm(x[:, start : start + dim].contiguous())
            torch.testing.assert_close(got, want[:, start : start + dim], rtol=1e-6, atol=1e-6)
        # q's and k's norms of a layer: one all-reduce of both sums ([n, 2]), the same results
        other = norm.tp.other
        norm.tp = _PeerSum(torch.cat([other, 4 * other], dim=-1))
        part = x[:, start : start + dim]
        with torch.no_grad():
            first, second = parallel_norm_pair(norm, norm, part, 2 * part)
        torch.testing.assert_close(first, want[:, start : start + dim], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(second, want_doubled[:, start : start + dim], rtol=1e-6, atol=1e-6)
        alone = RMSNorm(dim, spec.eps, spec.unit_offset)
        with torch.no_grad():
            alone.weight.copy_(norm.weight)
            assert not torch.allclose(alone(x[:, start : start + dim]), want[:, start : start + dim], atol=1e-3)
    with pytest.raises(ValueError, match="features"):
        ParallelRMSNorm(spec, 40, _PeerSum(torch.zeros(1)), 30, 64)
    with pytest.raises(ValueError, match="whole projection"):
        ParallelRMSNorm(spec, 40, _PeerSum(torch.zeros(1)), 0, 64).checkpoint_slice("weight", torch.ones(40))


def test_shard_plan_keeps_the_whole_models_sizes(phi3_dirs: dict[str, str]) -> None:  # noqa: F811
    """A rank's plan holds the whole model's head counts and intermediate rows its local config no longer has
    (Phi-3's fused tensors are split by them)."""
    cfg = load_model_config(phi3_dirs["phi35"])
    plans = [ShardPlan.make(cfg, r, 2) for r in range(2)]
    for plan in plans:
        assert (plan.total_q_size, plan.total_kv_size, plan.total_intermediate) == (64, 32, 128)
        assert plan.local_config(cfg).num_attention_heads == 2
    assert TensorParallelGroup(plans[1]).plan.q_rows == (32, 32)


# --- two ranks -----------------------------------------------------------------------------------------------


def test_olmo2_two_ranks_equal_one_and_transformers(olmo2_dir: str, two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """OLMo 2 over 2 ranks: each rank holds half of each q/k norm, the mean square is every head's; decode
    steps replay from the captured graph (the norms' all-reduces in it); tokens are one process's and
    transformers'."""
    prompts = _prompts(1)
    one, expected, two, got = _one_and_two(two_ranks, olmo2_dir, prompts)
    runner = two.llm_engine.model_runner
    attn = runner.model.model.layers[0].self_attn
    assert isinstance(attn.q_norm, ParallelRMSNorm) and isinstance(attn.k_norm, ParallelRMSNorm)
    assert (attn.q_norm.weight.shape, attn.q_norm.total_dim, attn.k_norm.weight.shape) == ((32,), 64, (16,))
    assert runner.tp.shm is not None and runner.captured_decode.graphs and runner.captured_decode.failed is None
    # every weight once over the ranks: the split norms are not counted as copies
    assert runner.num_params == one.llm_engine.model_runner.num_params
    assert got == expected
    assert got == _hf_tokens(olmo2_dir, prompts)


def test_phi4mini_folder_two_ranks_equal_one_and_transformers(phi3_dirs: dict[str, str],  # noqa: F811
                                                              two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """Phi-4-mini's fused checkpoint (partial rotation, tied head) over 2 ranks: each rank's q, k, v and gate,
    up rows; long and short LongRoPE prompts. (Phi-3.5's window and whole rotation: its GGUF file below.)"""
    prompts = _prompts(2)
    one, expected, two, got = _one_and_two(two_ranks, phi3_dirs["phi4mini"], prompts)
    assert two.llm_engine.model_runner.num_params == one.llm_engine.model_runner.num_params
    gate_up = two.llm_engine.model_runner.model.model.layers[0].mlp.gate_up_proj
    assert (gate_up.out_features, gate_up.in_features) == (2 * 64, 64)  # this rank's 64 of 128 rows, twice
    assert got == expected
    assert got == _hf_tokens(phi3_dirs["phi4mini"], prompts)


@pytest.fixture(scope="module")
def converted(phi3_dirs: dict[str, str], tiny_model_dirs: dict[str, str],  # noqa: F811
              tmp_path_factory: pytest.TempPathFactory, gguf_converter) -> Iterator:  # noqa: ANN001
    """``(name, outtype) -> path`` of llama.cpp's converter's files of Phi-3.5 and Llama 3 (rope_freqs)."""
    from gguf_convert import ConvertedModels

    yield ConvertedModels({**phi3_dirs, "llama3": tiny_model_dirs["llama3"]},
                          tmp_path_factory.mktemp("tp-gguf"), gguf_converter)


@pytest.mark.parametrize(("name", "outtype"), [("phi35", "f16"), ("llama3", "f32")])
def test_converted_gguf_two_ranks_equal_one(name: str, outtype: str, converted,  # noqa: ANN001
                                            two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """The converter's Phi-3.5 file (attn_qkv / ffn_up fused, kept as F16 blocks, split by rows of blocks)
    and its Llama 3 file (rope_freqs): one process's tokens over 2 ranks."""
    path = converted(name, outtype)
    cfg = load_model_config(path)
    assert cfg.checkpoint_format == "gguf"
    if name == "llama3":
        assert cfg.rope_freq_factors is not None
    one, expected, two, got = _one_and_two(two_ranks, path, _prompts(3))
    if outtype == "f16":
        mlp = two.llm_engine.model_runner.model.model.layers[0].mlp
        assert mlp.gate_up_proj.quant_method.name.startswith("gguf-f16")
    assert got == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "smollm3", "granite"])
def test_other_families_two_ranks_equal_one(arch: str, request: pytest.FixtureRequest,
                                            two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """Gemma 2 (softcaps), Gemma 3 (alternating windows, two RoPE tables), SmolLM3 (NoPE layers), Granite
    (multipliers) over 2 ranks: one process's tokens (which their own tests hold to transformers')."""
    dirs = request.getfixturevalue("gemma_dirs" if arch.startswith("gemma") else "smolgran_dirs")
    prompts = _prompts(4)
    _, expected, _, got = _one_and_two(two_ranks, dirs[arch], prompts)
    assert got == expected
