"""IQ4_NL, IQ4_XS and MXFP4 kept in their blocks (kernels/gguf/gguf_blocks.h, gguf_x16.h).

The oracle is the ``gguf`` package's own dequantization: the kernels' weights
must equal it exactly (every weight is one exact product), the file-order
kernel must be the float product with them, and the interleaved kernel (8-bit
activations, the table looked up by a byte shuffle) the float64 product of
the rounded activations with them, and the same bits for a row whatever its
batch. test_kernel_variants.py runs these on every ISA variant the CPU runs.
A tiny Llama whose matrices are held in each type then decodes as
transformers does on the dequantized weights.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch
from conftest import CapturingLLM as LLM
from conftest import assert_greedy_within_q8_noise, hf_greedy
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_write import finish, llama_writer, rope_order
from gguf_write import gguf_name as to_gguf_name

from pagedllm import SamplingParams
from pagedllm.kernels import load_kernels

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the GGUF kernels need the native build")

Q = GGMLQuantizationType
TYPES = [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]
X16 = {t: 512 + int(t) for t in TYPES}  # the kernels' numbers for the interleaved layout
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def random_blocks(ggml_type: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks, uint8 ``[rows, row bytes]``: random nibbles and scale bytes, fp16 d of a sane size;
    MXFP4 from gguf's own quantizer, with some E8M0 scales replaced by random ones (the subnormals 0, 1 too)."""
    rng = np.random.default_rng(seed)
    block_weights, size = GGML_QUANT_SIZES[ggml_type]
    num_blocks = cols // block_weights
    if ggml_type == Q.MXFP4:
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q.MXFP4).reshape(rows, num_blocks, size)
        pick = rng.random((rows, num_blocks)) < 0.3
        raw[:, :, 0] = np.where(pick, rng.integers(110, 135, size=(rows, num_blocks)), raw[:, :, 0])
        raw[0, :2, 0] = [0, 1]
        return raw.reshape(rows, num_blocks * size)
    raw = rng.integers(0, 256, size=(rows, num_blocks, size), dtype=np.uint8)
    scale = 0.002 if ggml_type == Q.IQ4_XS else 0.02
    for at in FP16_SCALES_AT.get(ggml_type, (0,)):
        halves = (rng.random((rows, num_blocks)) * scale + 0.05 * scale).astype(np.float16)
        raw[:, :, at:at + 2] = halves.view(np.uint8).reshape(rows, num_blocks, 2)
    return raw.reshape(rows, num_blocks * size)


# where a block's float16 scales sit (d, and dmin or m): every other byte of a block is valid at any value
FP16_SCALES_AT = {Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# the digest's types beyond TYPES: those whose AVX2 sums take another path than the scalar build's (16-bit
# lanes widened in batches: run_sums, kchunks)
DIGEST_TYPES = [*TYPES, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def reference(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """gguf's dequantization, float32 ``[rows, in_features]``."""
    return torch.from_numpy(np.asarray(dequantize(raw, ggml_type), dtype=np.float32))


def interleaved(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    weight = torch.from_numpy(raw.copy())
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    torch.ops.pagedllm.gguf_interleave_(weight, int(ggml_type), raw.shape[1] // block_bytes * block_weights)
    return weight


def q8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the 8-bit activations hold it: each run of 32 inputs dx * round(x / dx), dx = max |x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return (torch.round(blocks * inv).clamp(-127, 127) * dx).reshape(x.shape)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_weights_equal_ggufs_dequantization_in_both_layouts(ggml_type: GGMLQuantizationType) -> None:
    raw = random_blocks(ggml_type, 48, 512, seed=7)
    want = reference(raw, ggml_type)
    assert torch.isfinite(want).all() and want.abs().amax() > 0
    table = torch.from_numpy(raw)
    assert torch.equal(torch.ops.pagedllm.gguf_dequantize(table, int(ggml_type), 512), want)
    ids = torch.tensor([3, 0, 47, 3, 17])
    assert torch.equal(torch.ops.pagedllm.gguf_embedding(table, int(ggml_type), 512, ids), want[ids])
    weight = interleaved(raw, ggml_type)
    assert weight.shape == table.shape and not torch.equal(weight, table)  # the same size, another order
    assert torch.equal(torch.ops.pagedllm.gguf_dequantize(weight, X16[ggml_type], 512), want)
    ids = torch.tensor([47, 0, 16, 15, 31, 3])
    assert torch.equal(torch.ops.pagedllm.gguf_embedding(weight, X16[ggml_type], 512, ids), want[ids])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 7, 33])
def test_file_order_linear_is_the_float_product(ggml_type: GGMLQuantizationType, num_rows: int) -> None:
    raw = random_blocks(ggml_type, 37, 512, seed=num_rows)
    weight = reference(raw, ggml_type).double()
    gen = torch.Generator().manual_seed(num_rows)
    x, bias = torch.randn(num_rows, 512, generator=gen), torch.randn(37, generator=gen)
    got = torch.ops.pagedllm.gguf_linear(x, torch.from_numpy(raw), int(ggml_type), 512, bias).double()
    want = x.double() @ weight.T + bias.double()
    bound = 512 * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.abs().T) + 1e-6
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 6, 33])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 256), (160, 1536)])
def test_interleaved_linear_is_the_product_of_rounded_activations(
    ggml_type: GGMLQuantizationType, num_rows: int, out_features: int, in_features: int
) -> None:
    """Integer sums of the looked-up quants and the 8-bit rows are exact: only the float32 combination of the
    blocks' sums rounds. Checked against the float64 product of gguf's weights and the rounded rows, and
    against the file-order (float32 activations) kernel run on those rounded rows."""
    raw = random_blocks(ggml_type, out_features, in_features, seed=num_rows + out_features)
    weight = reference(raw, ggml_type).double()
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=gen) * 3
    x[0, :32] = 0.0  # a block of zeros: dx = 0
    bias = torch.randn(out_features, generator=gen)
    got = torch.ops.pagedllm.gguf_linear(x, interleaved(raw, ggml_type), X16[ggml_type], in_features, bias)
    rounded = q8_rows(x)
    want = rounded.double() @ weight.T + bias.double()
    bound = in_features * torch.finfo(torch.float32).eps * (rounded.double().abs() @ weight.abs().T) + 1e-5
    assert ((got.double() - want).abs() <= bound).all()
    float_path = torch.ops.pagedllm.gguf_linear(rounded, torch.from_numpy(raw), int(ggml_type), in_features, bias)
    assert ((got - float_path).double().abs() <= 2 * bound).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_batch(ggml_type: GGMLQuantizationType) -> None:
    """Bit for bit the same row alone, in a pair and in the whole batch, in both layouts."""
    raw = random_blocks(ggml_type, 64, 768, seed=3)
    x = torch.randn(150, 768, generator=torch.Generator().manual_seed(3))
    for weight, kind in ((torch.from_numpy(raw), int(ggml_type)), (interleaved(raw, ggml_type), X16[ggml_type])):
        together = torch.ops.pagedllm.gguf_linear(x, weight, kind, 768, None)
        for r in (0, 5, 133, 148, 149):
            for n in (1, 2):
                part = torch.ops.pagedllm.gguf_linear(x[r : r + n].contiguous(), weight, kind, 768, None)
                assert torch.equal(part, together[r : r + n])


def x16_digest() -> str:
    """A hash of the interleaved kernels' outputs for each type of DIGEST_TYPES (fixed random blocks and rows,
    1 and 7 rows):
    test_kernel_variants.py asks every ISA variant for it, which must give the default build's bits."""
    h = hashlib.sha256()
    for ggml_type in DIGEST_TYPES:
        weight = interleaved(random_blocks(ggml_type, 32, 512, seed=5), ggml_type)
        x = torch.randn(7, 512, generator=torch.Generator().manual_seed(5)) * 2
        for rows in (x[:1], x):
            h.update(torch.ops.pagedllm.gguf_linear(rows, weight, 512 + int(ggml_type), 512, None).numpy().tobytes())
    return h.hexdigest()


def test_bad_inputs_are_value_errors() -> None:
    raw = torch.from_numpy(random_blocks(Q.IQ4_XS, 40, 256, seed=1))
    with pytest.raises(ValueError, match="multiple of 256 for GGUF type 23"):
        torch.ops.pagedllm.gguf_linear(torch.randn(2, 64), raw[:, :34].contiguous(), int(Q.IQ4_XS), 64, None)
    with pytest.raises(ValueError, match="rows of 136 bytes"):
        torch.ops.pagedllm.gguf_linear(torch.randn(2, 256), raw[:, :100].contiguous(), int(Q.IQ4_XS), 256, None)
    with pytest.raises(ValueError, match="16 rows at a time, got 40"):
        torch.ops.pagedllm.gguf_interleave_(raw, int(Q.IQ4_XS), 256)
    mx = torch.from_numpy(random_blocks(Q.MXFP4, 16, 64, seed=1))
    with pytest.raises(ValueError, match=r"type 20 has rows of 36 bytes, got shape \[16, 34\]"):  # MXFP4 bytes as IQ4_NL
        torch.ops.pagedllm.gguf_linear(torch.randn(2, 64), mx, int(Q.IQ4_NL), 64, None)


# --- a tiny model held in each type ------------------------------------------------------------------------

def _nearest(w: np.ndarray, scale: np.ndarray, values: np.ndarray = IQ4NL_VALUES) -> np.ndarray:
    """Each weight's nibble: the index in ``values`` of the value nearest w / scale (w [..., n], scale [..., 1];
    the midpoints of the sorted values split the line)."""
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    scaled = w / np.where(scale == 0, 1, scale)
    return order[np.searchsorted((ranked[1:] + ranked[:-1]) / 2, scaled)].astype(np.uint8)


def _pack(q: np.ndarray) -> np.ndarray:
    """Runs of 32 nibbles [..., 32] as their 16 bytes: byte j = q[j] | q[j + 16] << 4."""
    return q[..., :16] | q[..., 16:] << 4


def quantize_iq4(w: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """``w`` [rows, cols] in IQ4_NL or IQ4_XS blocks (gguf has no quantizer for them): each block's (sub-block's)
    scale maps its largest weight to the table's -127, every weight takes the nearest table value."""
    rows = w.shape[0]
    runs = w.reshape(rows, -1, 32)
    target = runs[np.arange(rows)[:, None], np.arange(runs.shape[1]), np.abs(runs).argmax(-1)] / -127.0
    if ggml_type == Q.IQ4_NL:
        d = target.astype(np.float16)
        q = _nearest(runs, d.astype(np.float32)[..., None])
        return np.concatenate([d[..., None].view(np.uint8), _pack(q)], -1).reshape(rows, -1)
    sub = target.reshape(rows, -1, 8)  # [rows, super-blocks, 8]
    d = (np.abs(sub).max(-1) / 32.0).astype(np.float16)
    df = np.where(d == 0, 1, d).astype(np.float32)
    ls = (np.clip(np.round(sub / df[..., None]), -32, 31) + 32).astype(np.uint16)  # [rows, sb, 8]
    scale = d.astype(np.float32)[..., None] * (ls.astype(np.float32) - 32)
    q = _nearest(runs.reshape(rows, -1, 8, 32), scale[..., None])
    scales_h = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
    low = (ls & 15).astype(np.uint8)
    scales_l = low[..., 0::2] | low[..., 1::2] << 4
    parts = [d[..., None].view(np.uint8), scales_h[..., None].view(np.uint8), scales_l, _pack(q).reshape(*d.shape, 128)]
    return np.concatenate(parts, -1).reshape(rows, -1)


def quantize_mxfp4(w: np.ndarray) -> np.ndarray:
    """``w`` [rows, cols] in MXFP4 blocks, as gguf's quantizer picks the exponent (its largest weight near the
    top of the table) but vectorised for the tiny model's large rows."""
    rows = w.shape[0]
    runs = w.reshape(rows, -1, 32)
    amax = np.abs(runs).max(-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e.astype(np.uint32) - 1) << 23)
    q = _nearest(runs, bits.astype(np.uint32).view(np.float32)[..., None], MXFP4_VALUES)
    return np.concatenate([e[..., None], _pack(q)], -1).reshape(rows, -1)


def write_gguf(hf_model, ggml_type: GGMLQuantizationType, path: str) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """``hf_model`` (a Llama) as a GGUF file, every matrix but the token embedding (F16) in ``ggml_type``;
    returns the weights it holds (Hugging Face names, dequantized by gguf)."""
    cfg = hf_model.config
    writer = llama_writer(cfg, path)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.detach().float().numpy()
        gguf_name = to_gguf_name(name)
        if w.ndim != 2:
            writer.add_tensor(gguf_name, w)
            held[name] = tensor.detach().float()
            continue
        if gguf_name == "token_embd.weight":  # a lookup, not a product: F16 keeps the file quick to write
            writer.add_tensor(gguf_name, w.astype(np.float16))
            held[name] = torch.from_numpy(w.astype(np.float16).astype(np.float32))
            continue
        stored = w
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):  # llama.cpp's rotary row order, per head
            heads = cfg.num_attention_heads if "attn_q" in gguf_name else cfg.num_key_value_heads
            stored = rope_order(w, heads)
        def blocks_of(m: np.ndarray) -> np.ndarray:
            return quantize_mxfp4(m) if ggml_type == Q.MXFP4 else quantize_iq4(m, ggml_type)

        blocks = blocks_of(stored)
        writer.add_tensor(gguf_name, blocks, raw_dtype=ggml_type)
        # rows are whole blocks, so quantizing in Hugging Face's row order rounds each row the same
        same = blocks if stored is w else blocks_of(w)
        held[name] = torch.from_numpy(np.asarray(dequantize(same, ggml_type), np.float32))
    finish(writer)
    return held


@pytest.fixture(scope="module")
def hf_wide_llama():  # noqa: ANN201
    """A tiny random Llama whose rows are whole IQ4_XS super-blocks (hidden 256, intermediate 512)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, rope_theta=10000.0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_tiny_model_held_in_the_type_decodes_as_its_dequantized_copy(
    ggml_type: GGMLQuantizationType, hf_wide_llama, tiny_model_dirs: dict[str, str],  # noqa: ANN001
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import copy

    hf = copy.deepcopy(hf_wide_llama)
    path = os.path.join(tmp_path_factory.mktemp("gguf-iq4"), f"tiny-{ggml_type.name}.gguf")
    hf.load_state_dict(write_gguf(hf, ggml_type, path))  # transformers runs what the file's blocks hold
    name = ggml_type.name.lower()
    prompts = [[1, 400, 3000, 77, 12000, 5], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    common = dict(tokenizer=tiny_model_dirs["llama"], max_model_len=256, num_kv_blocks=64, kv_cache_dtype="float32")
    llm = LLM(path, **common)
    model = llm.llm_engine.model_runner.model
    layer = model.model.layers[0]
    assert model.lm_head.quant_method.name == f"gguf-{name}-x16"
    assert layer.self_attn.qkv_proj.quant_method.name == f"gguf-{name}-x16"
    assert layer.mlp.down_proj.quant_method.name == f"gguf-{name}-x16"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):  # 8-bit activations: transformers' tokens up to their rounding
        assert_greedy_within_q8_noise(hf, prompt, out.outputs[0].token_ids)
    del llm
    # on float32 activations, the file's blocks give transformers' tokens exactly
    llm = LLM(path, **common, gguf_activations="float32")
    assert llm.llm_engine.model_runner.model.lm_head.quant_method.name == f"gguf-{name}"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)
