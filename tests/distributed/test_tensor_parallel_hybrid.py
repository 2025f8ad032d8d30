"""Tensor parallelism for hybrid models: each rank a slice of every state layer's heads, and of its state.

First without processes: each state layer built as two ranks' shards, each loaded with its slice of one
checkpoint through the loader's own path (``load_hf_weights``, the fused map, ``checkpoint_slice``), run over a
prompt in chunks and then decodes from scattered slots; the two ranks' partial sums (what ``out_proj``'s
all-reduce adds) must be the whole layer's output, and each rank's state its heads' slice of the whole
layer's state (Gated DeltaNet, Mamba-2, LFM2's short conv). Then two real ranks (processes, gloo and shared
memory) against one process and transformers, on the tiny checkpoints of the families' own tests: Qwen3.5
(Gated DeltaNet and gated attention) from its folder and its converted GGUF file, and LFM2; in the slow tier
Qwen3-Next (interleaved projections), Qwen3.5-MoE and Granite 4.0-H (Mamba-2), all with experts, against one
process. Each two-rank engine runs a prompt cut into chunks, then its next turn, which hits the first's cached
blocks and state snapshot.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import hf_greedy
from test_family_granitemoehybrid import granite_dir  # noqa: F401 (a fixture)
from test_family_qwen3_next import folders, ggufs  # noqa: F401 (fixtures)
from test_tensor_parallel import TwoRankEngines, _restore_threads, _tp, two_ranks  # noqa: F401

from pagedllm import SamplingParams
from pagedllm.distributed.shard_plan import ShardPlan, state_layer_split
from pagedllm.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec, whole_model_spec
from pagedllm.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from pagedllm.layers.short_conv import ShortConv
from pagedllm.layers.weights import load_hf_weights
from pagedllm.loader import load_model_config
from pagedllm.loader.granite_hybrid_config import Mamba2Config

GENERATED = 8
NUM_SLOTS = 4


# --- the plan (no processes) ---------------------------------------------------------------------------------


def test_state_layers_split_by_heads_and_refuse_what_does_not_divide(folders: dict[str, str]) -> None:  # noqa: F811
    """Qwen3.5's 2 key and 4 value heads: one key head and the two value heads reading it per rank; the rank's
    config holds its share. Key heads, Mamba-2 groups or heads not divisible by the ranks are refused, naming
    the layer and the counts."""
    cfg = load_model_config(folders["qwen3_5"])
    plans = [ShardPlan.make(cfg, r, 2) for r in range(2)]
    assert [(p.linear_k_heads, p.linear_v_heads) for p in plans] == [((0, 1), (0, 2)), ((1, 1), (2, 2))]
    local = plans[1].local_config(cfg)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    assert (local.linear_key_head_dim, local.layer_types) == (cfg.linear_key_head_dim, cfg.layer_types)
    three = dataclasses.replace(cfg, linear_num_key_heads=3, linear_num_value_heads=6)
    with pytest.raises(ValueError, match=r"Gated DeltaNet layers' 3 key heads and 6 value heads"):
        ShardPlan.make(three, 0, 2)
    mamba = dataclasses.replace(cfg, layer_types=("mamba",) * 3 + ("full_attention",),
                                mamba=Mamba2Config(8, 16, 16, 2, 4, 128))
    assert state_layer_split(mamba, 2) == {"mamba_heads": [(0, 4), (4, 4)], "mamba_groups": [(0, 1), (1, 1)]}
    assert ShardPlan.make(mamba, 1, 2).local_config(mamba).mamba == Mamba2Config(4, 16, 16, 1, 4, 64)
    with pytest.raises(ValueError, match=r"Mamba-2 layers' 1 groups and 8 heads"):
        ShardPlan.make(dataclasses.replace(mamba, mamba=Mamba2Config(8, 16, 16, 1, 4, 128)), 0, 2)
    conv = dataclasses.replace(cfg, layer_types=("conv",) * 3 + ("full_attention",), hidden_size=66)
    assert state_layer_split(conv, 4) == {"conv_channels": [(0, 17), (17, 17), (34, 16), (50, 16)]}


# --- each state layer as two ranks' shards (no processes) ----------------------------------------------------


class _Rank:
    """One rank of a two-rank group in this process: its plan; the all-reduce leaves its partial sum."""

    def __init__(self, rank: int, **slices: tuple[int, int]) -> None:
        none = (0, 0)
        self.plan = ShardPlan(rank, 2, none, none, none, none, (), 16, 0, 0, 0, **slices)
        self.rank, self.size, self.is_driver = rank, 2, rank == 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _meta(lens: list[int], slots: list[int], initial: list[bool], num_prefills: int) -> SimpleNamespace:
    loc = [0]
    for n in lens:
        loc.append(loc[-1] + n)
    return SimpleNamespace(query_start_loc=loc, seq_lens=lens, num_prefills=num_prefills,
                           state_slots=torch.tensor(slots), has_initial_state=torch.tensor(initial))


# a prompt of 13 tokens in slot 2 (chunks of 8 and 5), then 4 decodes beside a fresh 3-token prompt in slot 0
_STEPS = [([8], [2], [False], 1), ([5], [2], [True], 1)] + [([3, 1], [0, 2], [False, True], 1)] * 4


def _run_steps(layer: torch.nn.Module, states: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    """The layer over ``_STEPS`` (the prompt's tokens from ``x``, the fresh prompt's its first 3): all outputs."""
    outs, t = [], 0
    for lens, slots, initial, prefills in _STEPS:
        rows = x[t : t + lens[-1]] if len(lens) == 1 else torch.cat([x[:3], x[t : t + 1]])
        t += lens[-1]
        with torch.no_grad():
            outs.append(layer(rows, states, _meta(lens, slots, initial, prefills)))
    return torch.cat(outs)


def _load(layer: torch.nn.Module, name: str, weights: dict[str, torch.Tensor], fused: dict) -> torch.nn.Module:
    holder = torch.nn.Module()
    setattr(holder, name, layer)
    load_hf_weights(holder, ((f"{name}.{k}", v) for k, v in weights.items()), fused, False)
    return layer


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=gen) * 0.3 for name, shape in shapes.items()}


def _zero_states(shapes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
    """A layer's states of ``NUM_SLOTS`` slots, zeros."""
    return tuple(torch.zeros(NUM_SLOTS, *shape) for shape in shapes)


def _state_rows(heads: int, widths: tuple[int, ...], shares: tuple[int, ...]):  # noqa: ANN202
    """``state_rows`` for ``_check_shards`` of a layer with a conv state and a per-head state: rank r's
    ``heads`` heads of state 1 (dim 1), and of the conv state (state 0) its ``shares[j]`` channels of each
    segment ``j`` of ``widths`` (q | k | v, x | B | C), joined."""

    def rows(r: int, i: int, state: torch.Tensor) -> torch.Tensor:
        if i == 1:
            return state[:, heads * r : heads * (r + 1)]
        parts = state.split(list(widths), dim=-1)
        return torch.cat([p[..., n * r : n * (r + 1)] for p, n in zip(parts, shares, strict=True)], dim=-1)

    return rows


def _check_shards(whole: torch.nn.Module, ranks: list[torch.nn.Module], make_states, hidden: int,  # noqa: ANN001
                  state_rows) -> None:  # noqa: ANN001
    """The ranks' partial outputs add up to the whole layer's; each rank's states are ``state_rows(rank, whole's
    state index, whole's state)``."""
    x = torch.randn(40, hidden, generator=torch.Generator().manual_seed(7))
    whole_states = make_states(whole)
    want = _run_steps(whole, whole_states, x)
    rank_states = [make_states(layer) for layer in ranks]
    got = sum(_run_steps(layer, states, x) for layer, states in zip(ranks, rank_states))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for r, states in enumerate(rank_states):
        for i, state in enumerate(states):
            torch.testing.assert_close(state, state_rows(r, i, whole_states[i]), atol=1e-5, rtol=1e-5)


def test_gated_deltanet_shards_add_up_to_the_whole_layer() -> None:
    """Qwen3.5's projections (2 key heads, 4 value heads) over two ranks: rank r holds key head r, value heads
    2r and 2r + 1 (q, k and v rows of in_proj_qkv and of the conv, z/b/a rows, A_log, dt_bias) and their
    states; its out_proj columns' partial sums add up to the whole layer's output."""
    spec = GatedDeltaNetSpec(64, 2, 4, 16, 16, 4, 1e-6, chunk_size=4)
    weights = _random({"in_proj_qkv.weight": (spec.conv_dim, 64), "in_proj_z.weight": (64, 64),
                       "in_proj_b.weight": (4, 64), "in_proj_a.weight": (4, 64),
                       "conv1d.weight": (spec.conv_dim, 1, 4), "A_log": (4,), "dt_bias": (4,),
                       "norm.weight": (16,), "out_proj.weight": (64, 64)}, seed=1)
    whole = _load(GatedDeltaNet(spec), "linear_attn", weights, GatedDeltaNet.fused_map(spec))
    local = dataclasses.replace(spec, num_k_heads=1, num_v_heads=2)
    ranks = []
    for r in range(2):
        tp = _Rank(r, linear_k_heads=(r, 1), linear_v_heads=(2 * r, 2))
        ranks.append(_load(GatedDeltaNet(local, tp=tp), "linear_attn", weights, GatedDeltaNet.fused_map(local, tp)))
    assert ranks[1].out_proj.input_start == 32 and ranks[1].conv1d.weight.shape == (64, 1, 4)

    # the recurrent state [slots, value heads, dk, dv]: 2 value heads a rank; the conv state's channels q | k | v
    _check_shards(whole, ranks, lambda layer: _zero_states(layer.state_shapes()), 64,
                  _state_rows(2, (32, 32, 64), (16, 16, 32)))


def test_qwen3_next_rows_split_by_the_whole_models_heads() -> None:
    """Qwen3-Next's interleaved rows are split by every key head (the rank's spec has its own only)."""
    local = GatedDeltaNetSpec(64, 1, 2, 16, 16, 4, 1e-6)
    whole = whole_model_spec(local, 2)
    assert (whole.num_k_heads, whole.num_v_heads, whole.head_k_dim) == (2, 4, 16)
    assert whole_model_spec(local, 1) is local


def test_mamba2_shards_add_up_to_the_whole_mixer() -> None:
    """Granite 4.0-H's mixer (8 heads, 2 groups) over two ranks: rank r holds group r and heads 4r..4r+3 (z, x,
    B, C and dt rows of in_proj, x / B / C channels of the conv and its bias, the norm's channels, A_log, D,
    dt_bias) and their states; the out_proj partial sums add up to the whole mixer's output."""
    spec = Mamba2Spec(64, 8, 16, 16, 2, 4, 128, chunk_size=8)
    weights = _random({"in_proj.weight": (128 + spec.conv_dim + 8, 64), "conv1d.weight": (spec.conv_dim, 1, 4),
                       "conv1d.bias": (spec.conv_dim,), "dt_bias": (8,), "A_log": (8,), "D": (8,),
                       "norm.weight": (128,), "out_proj.weight": (64, 128)}, seed=2)
    weights["norm.weight"] += 1.0
    whole = _load(Mamba2Mixer(spec), "mamba", weights, {})
    local = dataclasses.replace(spec, num_heads=4, num_groups=1, intermediate_size=64)
    ranks = [_load(Mamba2Mixer(local, tp=_Rank(r, mamba_heads=(4 * r, 4), mamba_groups=(r, 1))), "mamba", weights,
                   {}) for r in range(2)]
    assert ranks[1].in_proj.out_features == 64 + local.conv_dim + 4

    # the SSM state [slots, heads, head_dim, state]: 4 heads a rank; the conv state's channels x | B | C
    _check_shards(whole, ranks, lambda layer: _zero_states(layer.spec.state_shapes()), 64,
                  _state_rows(4, (128, 32, 32), (64, 16, 16)))


def test_short_conv_shards_add_up_to_the_whole_conv() -> None:
    """LFM2's short conv over two ranks of 40 and 24 of its 64 channels: each its rows of B, C and x, its
    filters and conv state; the out_proj partial sums add up to the whole conv's output."""
    weights = _random({"in_proj.weight": (192, 64), "out_proj.weight": (64, 64), "conv_weight": (64, 3)}, seed=3)
    whole = _load(ShortConv(64, 3, False, None, "conv"), "conv", weights, {})
    ranks = [_load(ShortConv(64, 3, False, None, "conv", _Rank(r, conv_channels=span)), "conv", weights, {})
             for r, span in enumerate([(0, 40), (40, 24)])]
    assert [layer.state_shapes() for layer in ranks] == [((2, 40),), ((2, 24),)]

    def states(layer: ShortConv) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(NUM_SLOTS, *shape) for shape in layer.state_shapes())

    def rank_rows(r: int, i: int, state: torch.Tensor) -> torch.Tensor:
        return state[..., :40] if r == 0 else state[..., 40:]

    _check_shards(whole, ranks, states, 64, rank_rows)


# --- two ranks -----------------------------------------------------------------------------------------------

ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=16)
_LONG, _TAIL = ([random.Random(5).randrange(100, 49000) for _ in range(n)] for n in (70, 9))
PREFIX_HIT = 64  # the first prompt's 8 full blocks of 8, and the state snapshot after them


def _turns(llm) -> tuple[list[list[int]], int]:  # noqa: ANN001
    """Greedy tokens of a 70-token prompt (5 chunks of 16), then of its next turn (9 tokens more) after it has
    finished; and how many of the second's prompt tokens were cached."""
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": _LONG}], params, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": _LONG + _TAIL}], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in first + second], second[0].num_cached_tokens


def _hf_tokens(path: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, GENERATED) for p in (_LONG, _LONG + _TAIL)]


def _one_and_two(two_ranks: TwoRankEngines, path: str) -> tuple:  # noqa: F811
    """(one process's tokens, the two-rank engine, its tokens) of ``path``, each with its prefix hit checked."""
    one = _tp(path, 1, **ENGINE)
    expected, hit = _turns(one)
    num_params = one.llm_engine.model_runner.num_params
    one.shutdown()
    assert hit == PREFIX_HIT
    two = two_ranks.shared(path, **ENGINE)
    got, hit = _turns(two)
    assert hit == PREFIX_HIT
    return expected, num_params, two, got


def test_qwen3_5_folder_two_ranks_equal_one_and_transformers(folders: dict[str, str],  # noqa: F811
                                                              two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """Qwen3.5 (three Gated DeltaNet layers, one gated attention) over 2 ranks: each rank one key head, two value
    heads and their states, one KV head and two query heads with their gate rows; chunked prompt, prefix hit
    and captured decode steps give one process's and transformers' tokens."""
    path = folders["qwen3_5"]
    expected, num_params, two, got = _one_and_two(two_ranks, path)
    runner = two.llm_engine.model_runner
    # every weight counted once over the ranks: the replicated norms, the gated ones included, not twice
    assert runner.num_params == num_params
    gdn = runner.model.model.layers[0].linear_attn
    assert (gdn.spec.num_k_heads, gdn.spec.num_v_heads, gdn.out_proj.in_features) == (1, 2, 32)
    assert [tuple(t.shape[1:]) for t in runner.state_caches[0]] == [(3, 64), (2, 16, 16)]  # this rank's heads
    assert runner.captured_decode is not None and runner.captured_decode.failed is None
    assert got == expected
    assert got == _hf_tokens(path)


@pytest.mark.slow  # converts the checkpoint in a subprocess (seconds)
def test_qwen3_5_gguf_two_ranks_equal_one(ggufs: dict, two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """llama.cpp's qwen35 file (F16 blocks as stored, value heads reordered back to grouped order before the
    split) over 2 ranks: one process's tokens."""
    path = ggufs["qwen3_5", "f16"]
    expected, _, two, got = _one_and_two(two_ranks, path)
    gdn = two.llm_engine.model_runner.model.model.layers[0].linear_attn
    assert gdn.in_proj.quant_method.name.startswith("gguf")
    assert got == expected


def test_lfm2_two_ranks_equal_one_and_transformers(lfm2_dir: str, two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """LFM2 over 2 ranks: each rank 32 of the short convs' 64 channels and their conv state, one KV head of the
    attention layer; chunked prompt and prefix hit give one process's and transformers' tokens."""
    expected, num_params, two, got = _one_and_two(two_ranks, lfm2_dir)
    runner = two.llm_engine.model_runner
    assert runner.num_params == num_params
    assert runner.model.model.layers[0].conv.channels == 32
    assert [tuple(t.shape[1:]) for t in runner.state_caches[0]] == [(2, 32)]
    assert got == expected
    assert got == _hf_tokens(lfm2_dir)


@pytest.mark.slow  # two more engines of each family, beside the dense ones above
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "granite"])
def test_hybrids_with_experts_two_ranks_equal_one(family: str, request: pytest.FixtureRequest,
                                                  two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """Qwen3-Next (its interleaved in_proj_qkvz / in_proj_ba split by the whole model's key heads, then each
    rank's rows taken), Qwen3.5-MoE and Granite 4.0-H (each rank 4 of the Mamba-2 mixers' 8 heads and 1 of their
    2 groups), all with experts and a gated or plain shared expert, over 2 ranks: one process's tokens."""
    path = request.getfixturevalue("granite_dir") if family == "granite" \
        else request.getfixturevalue("folders")[family]
    expected, _, two, got = _one_and_two(two_ranks, path)
    layer = two.llm_engine.model_runner.model.model.layers[0]
    if family == "granite":
        assert (layer.mamba.spec.num_heads, layer.mamba.spec.num_groups) == (4, 1)
    else:
        assert layer.linear_attn.spec.num_k_heads == 1
    assert got == expected
