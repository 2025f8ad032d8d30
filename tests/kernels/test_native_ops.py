"""Native elementwise ops (RMSNorm + residual, RoPE, SiLU-and-multiply, Gated DeltaNet's gated norm) against
their torch twins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import CapturingLLM as LLM  # decode steps captured from the first, as the tests mean

from pagedllm import SamplingParams
from pagedllm.kernels import load_kernels
from pagedllm.layers.gated_deltanet import GatedRMSNorm
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return NativeOps(lib)


# 1 and 5 rows stay on one thread, 300 x 576 floats are split over threads
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(ops: NativeOps, rows: int, with_delta: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    x = torch.randn(rows, 576, generator=gen) * 3
    delta = torch.randn(rows, 576, generator=gen) if with_delta else None
    want_x = x + delta if with_delta else x.clone()
    want = norm(want_x)  # the torch path (norm.native is None)
    got = ops.add_rms_norm(x, delta, norm.weight.data, norm.eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, want_x)  # the residual add happened in place, exactly


@pytest.mark.parametrize("rows", [1, 7])
def test_unit_offset_norm_runs_native_with_one_plus_weight(ops: NativeOps, rows: int) -> None:
    """Gemma's norm (``rms_norm(x) * (1 + w)``) through the native kernel equals its torch path."""
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-6, unit_offset=True)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen) * 0.3)
    x = torch.randn(rows, 576, generator=gen) * 3
    want, want_sum = norm(x), norm.add_forward(x.clone(), x)  # torch
    norm.use_native(ops)
    torch.testing.assert_close(norm.native_weight, 1.0 + norm.weight.detach())
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.add_forward(x.clone(), x), want_sum, rtol=1e-5, atol=1e-5)
    norm.use_native(None)
    assert norm.native is None and norm.native_weight is None


@pytest.mark.parametrize("head_dim", [16, 20, 64, 128])
@pytest.mark.parametrize("rows", [1, 7, 200])
@pytest.mark.parametrize("head_norms", [False, True])
def test_rope_matches_torch(ops: NativeOps, head_dim: int, rows: int, head_norms: bool) -> None:
    gen = torch.Generator().manual_seed(head_dim + rows)
    num_heads, num_kv_heads = 6, 2
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    cos, sin = rotary.cos_sin(positions, torch.float32)  # [rows, 1, head_dim] each
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)  # q, k, v side by side
    qk_heads = num_heads + num_kv_heads
    q = qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : qk_heads * head_dim].view(rows, num_kv_heads, head_dim)
    norms = (None, None)
    if head_norms:  # Qwen3: each q and k head RMS-normed (torch path: norm.native is None) before RoPE
        q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
        q_norm.weight.data, k_norm.weight.data = torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen)
        q, k = q_norm(q), k_norm(k)
        norms = (q_norm.weight.data, k_norm.weight.data)
    want = RotaryEmbedding.apply(torch.cat([q, k], dim=1), (cos, sin))
    v_before = qkv[:, qk_heads * head_dim :].clone()
    ops.qk_norm_rope_(qkv, num_heads, num_kv_heads, head_dim, cos.view(rows, head_dim), sin.view(rows, head_dim),
                      *norms, 1e-6)
    torch.testing.assert_close(qkv[:, : qk_heads * head_dim].view(rows, qk_heads, head_dim), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, qk_heads * head_dim :], v_before)  # v is neither normed nor rotated


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 37), (64, 1536)])
def test_silu_mul_matches_torch(ops: NativeOps, rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6  # large |gate| too: exp near its limits
    gate_up[0, 0], gate_up[-1, inter - 1] = 100.0, -100.0
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    # a NaN gate gives NaN, as torch's silu does
    gate_up[0, :inter] = float("nan")
    got = ops.silu_mul(gate_up)
    assert got[0].isnan().all() and not got[1:].isnan().any()


@pytest.mark.parametrize(("rows", "heads", "head_dim", "tiled"), [(1, 32, 128, 16), (5, 4, 16, 2), (300, 8, 24, 0),
                                                             (3, 6, 7, 3), (0, 4, 8, 0)])
def test_gated_rms_norm_matches_torch(ops: NativeOps, rows: int, heads: int, head_dim: int, tiled: int) -> None:
    """``rms_norm(x) * w * silu(z)`` per head, heads written as given or tiled over key heads; z a strided view of
    a wider projection (as Gated DeltaNet's in_proj output hands it); against torch and against float64."""
    gen = torch.Generator().manual_seed(rows + heads)
    norm = GatedRMSNorm(head_dim, 1e-6, tiled)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(head_dim, generator=gen))
    x = torch.randn(rows, heads, head_dim, generator=gen) * 3
    proj = torch.randn(rows, heads * head_dim + 5, generator=gen)
    z = proj[:, 2 : 2 + heads * head_dim].view(rows, heads, head_dim)
    want = norm(x, z)  # the torch path
    norm.select_impl(ops)
    got = norm(x, z)
    assert got.shape == (rows, heads * head_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    xd, zd = x.double(), z.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double() * F.silu(zd)
    if tiled:  # head k * group + g at g * tiled + k
        exact = exact.view(rows, tiled, heads // tiled, head_dim).transpose(1, 2)
    torch.testing.assert_close(got.double(), exact.flatten(1), rtol=1e-4, atol=1e-4)
    if rows > 1:  # a row alike alone and among others
        assert torch.equal(norm(x[1:2], z[1:2])[0], got[1])


def test_gated_rms_norm_refuses_bad_input(ops: NativeOps) -> None:
    x, w = torch.randn(3, 4, 8), torch.ones(8)
    for args in ((x, torch.randn(3, 4, 9), w, 0), (x, x, torch.ones(7), 0), (x, x, w, 3),
                 (x.transpose(1, 2).contiguous().transpose(1, 2), x, w, 0), (x.double(), x.double(), w, 0)):
        with pytest.raises(ValueError, match="gated_rms_norm"):
            ops.gated_rms_norm(args[0], args[1], args[2], 1e-6, args[3])


def test_native_ops_refuse_what_they_cannot_run(ops: NativeOps) -> None:
    w = torch.ones(8)
    with pytest.raises(ValueError, match="float32"):
        ops.add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), None, w, 1e-6)
    with pytest.raises(ValueError, match="rows of 8"):
        ops.add_rms_norm(torch.ones(2, 9), None, w, 1e-6)
    with pytest.raises(ValueError, match="shaped like x"):
        ops.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), w, 1e-6)
    with pytest.raises(ValueError, match="does not hold"):
        ops.qk_norm_rope_(torch.ones(2, 16), 2, 1, 8, torch.ones(2, 8), torch.ones(2, 8))
    with pytest.raises(ValueError, match="even"):
        ops.qk_norm_rope_(torch.ones(2, 14), 1, 1, 7, torch.ones(2, 7), torch.ones(2, 7))
    with pytest.raises(ValueError, match="both"):
        ops.qk_norm_rope_(torch.ones(2, 16), 1, 1, 8, torch.ones(2, 8), torch.ones(2, 8), torch.ones(8), None)
    with pytest.raises(ValueError, match="head norm weight"):
        ops.qk_norm_rope_(torch.ones(2, 16), 1, 1, 8, torch.ones(2, 8), torch.ones(2, 8), torch.ones(7), torch.ones(7))
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.ones(8, 4).t())


def test_engine_uses_native_ops_and_matches_the_torch_path(tiny_model_dirs: dict[str, str]) -> None:
    """Greedy tokens with the native ops equal those of the plain torch ops (and the test
    suite compares the default, native, path with transformers)."""
    prompts = [{"prompt_token_ids": list(range(200 + 7 * i, 230 + 11 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for arch in ("llama", "qwen3"):  # qwen3: its q/k norms run natively in the same pass as RoPE
        llm = LLM(tiny_model_dirs[arch], num_kv_blocks=64, max_model_len=256, block_size=8)
        runner = llm.llm_engine.model_runner
        assert runner.native_ops is not None
        assert runner.model.model.layers[0].mlp.act_fn.native is runner.native_ops
        # every step layer by layer, so the switch below decides every step's ops
        # (captured decode steps are compared with this path in test_captured_decode.py)
        runner.captured_decode = None
        native = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner.model.use_native_ops(None)
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert native == plain, arch


def test_no_native_ops_off_the_float32_cpu_path(tiny_model_dirs: dict[str, str]) -> None:
    """float16 on the CPU is a plain torch model (bfloat16 keeps float32 activations, so it uses them)."""
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=32, max_model_len=128, block_size=8, dtype="float16")
    runner = llm.llm_engine.model_runner
    assert runner.native_ops is None
    assert all(m.native is None for m in runner.model.model.layers[0].modules() if hasattr(m, "native"))


_MAPPED_OPENMP = """
import json, torch
from pagedllm.kernels import load_kernels
assert load_kernels() is not None
torch.ops.pagedllm.silu_mul(torch.randn(4, 8))
with open("/proc/self/maps") as f:
    # the path field (the 6th) may end in " (deleted)" when a test's cache folder was removed since
    rows = [line.split(maxsplit=5) for line in f]
mapped = {row[5].strip().removesuffix(" (deleted)") for row in rows if len(row) == 6}
print(json.dumps(sorted(mapped)))
"""


def test_the_kernels_run_on_torchs_own_openmp_runtime() -> None:
    """One thread pool: the kernels' OpenMP is the libgomp torch loaded, not a second copy. In a fresh
    interpreter, which loads torch and the kernels only (other tests import libraries with their own
    libgomp, scikit-learn's through sentence-transformers, which says nothing about the kernels)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MAPPED_OPENMP], capture_output=True, text=True, timeout=300,
                         check=True)
    mapped = set(json.loads(out.stdout.strip().splitlines()[-1]))
    gomp = {p for p in mapped if "libgomp" in p.rsplit("/", 1)[-1]}
    assert len(gomp) == 1, gomp
    assert Path(gomp.pop()).parent == Path(torch.__file__).parent / "lib", "the kernels loaded an OpenMP runtime of their own"
    assert any("pagedllm_kernels" in p for p in mapped)


