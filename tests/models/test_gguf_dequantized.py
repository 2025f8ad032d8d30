"""GGUF types with no kernel here load dequantized to bfloat16, not float32 (issue 48).

A tiny Llama (dimensions of whole 256-weight blocks) is written as a GGUF file with the gguf package:
TQ2_0 (quantized by gguf) for the embedding, v_proj, o_proj and the LM head, IQ2_XXS (valid random blocks:
gguf has no IQ quantizer) for down_proj, Q8_0 for q/k/gate/up. The no-kernel tensors must load as bf16
(the fused qkv, with its Q8_0 parts, too), the Q8_0 gate/up stay in their blocks, one log line names what
was dequantized, and greedy tokens equal transformers' on the same values: the file's weights dequantized
by gguf, rounded to bf16 where pagedllm holds bf16, and the inputs of those linear layers rounded to bf16,
as the bf16 kernel rounds them (float32 activations elsewhere, ``gguf_activations="float32"``).
"""

from __future__ import annotations

import copy
import logging
import os
import zlib

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_write import finish, llama_writer, rope_order
from gguf_write import gguf_name as to_gguf_name

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization.packed_linear import packed_linear_bf16_native

# HF name suffix -> the type the file stores it in (the rest: Q8_0, norms F32)
TYPES = {
    "embed_tokens.weight": Q.TQ2_0, "v_proj.weight": Q.TQ2_0, "o_proj.weight": Q.TQ2_0, "lm_head.weight": Q.TQ2_0,
    "down_proj.weight": Q.IQ2_XXS,
}
# the transformers modules whose weights pagedllm holds in bf16, and whose inputs its bf16 kernel rounds
BF16_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "lm_head")
pytestmark = pytest.mark.skipif(not packed_linear_bf16_native(), reason="no vector bf16 kernel on this CPU")


def _iq2_xxs_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random IQ2_XXS blocks (any grid index, sign and scale bits), each block's fp16 scale 0.01-0.02."""
    block_weights, size = GGML_QUANT_SIZES[Q.IQ2_XXS]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block_weights, size), dtype=np.uint8)
    scales = (0.01 + 0.01 * rng.random((rows, cols // block_weights))).astype(np.float16)
    raw[:, :, 0:2] = scales.view(np.uint8).reshape(rows, cols // block_weights, 2)
    return raw.reshape(rows, -1)



def _write(hf_model, path: str, types: dict[str, Q]) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """``hf_model`` as a llama GGUF file in ``types`` (Q8_0 otherwise); returns what gguf dequantizes each
    weight to (HF names, HF row order)."""
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
        kind = next((t for sfx, t in types.items() if name.endswith(sfx)), Q.Q8_0)
        blocks = _iq2_xxs_blocks(*w.shape, zlib.crc32(name.encode())) if kind == Q.IQ2_XXS else quantize(w, kind)
        values = np.asarray(dequantize(blocks, kind), np.float32)  # rows whole blocks: row order does not matter
        stored = blocks
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gguf_name else cfg.num_key_value_heads
            stored = rope_order(blocks, heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(stored), raw_dtype=kind)
        held[name] = torch.from_numpy(values)
    finish(writer)
    return held


@pytest.fixture(scope="module")
def dequantized_file(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer):  # noqa: ANN001, ANN201
    """(file path, tokenizer folder, transformers model on the file's values)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, rope_theta=10000.0)
    torch.manual_seed(1234)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("gguf-dequantized")
    smollm_tokenizer.save_pretrained(folder)
    path = os.path.join(folder, "tiny-tq2_0-iq2_xxs.gguf")
    held = _write(hf, path, TYPES)
    oracle = copy.deepcopy(hf)
    # what pagedllm holds: bf16 for the layers with a no-kernel part (the fused qkv's Q8_0 q/k too)
    for name, values in held.items():
        if any(name.endswith(f"{m}.weight") for m in (*BF16_LINEARS, "embed_tokens")):
            held[name] = values.to(torch.bfloat16).float()
    oracle.load_state_dict(held)
    return path, str(folder), oracle


def _bf16_inputs(model) -> list:  # noqa: ANN001
    """Round the inputs of ``BF16_LINEARS`` to bf16, as the bf16 kernel does (to nearest even)."""
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        return (args[0].to(torch.bfloat16).float(), *args[1:])

    return [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in BF16_LINEARS]


@pytest.mark.slow  # the fast tier's tests/kernels/test_gguf_quantized.py covers an NVFP4 file's bf16 layers
def test_no_kernel_types_load_as_bf16_and_match_transformers(
    dequantized_file: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    path, tokenizer, oracle = dequantized_file
    with caplog.at_level(logging.WARNING, logger="pagedllm.runner.model_loader"):
        llm = LLM(path, tokenizer=tokenizer, max_model_len=256, num_kv_blocks=64, kv_cache_dtype="float32",
                  gguf_activations="float32")
    # one line: how many, to what, which types
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("12 GGUF tensors are dequantized to bfloat16 (packed_bf16 linears): types "
                               "['IQ2_XXS', 'TQ2_0'] have no kernel here (with the ['Q8_0'] parts of the same "
                               "fused layers)")
    model = llm.llm_engine.model_runner.model
    embed = model.model.embed_tokens
    assert embed.quant_method.name == "gguf-dequantized-bf16" and embed.weight.dtype == torch.bfloat16
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj, model.lm_head):
        assert linear.quant_method.name == "packed_bf16" and linear.packed_weight.dtype == torch.bfloat16
        assert linear.weight is None  # no float32 copy kept
    assert layer.mlp.gate_up_proj.quant_method.name == "gguf-q8_0"  # a type with a kernel stays in its blocks
    # bytes: the bf16 tables and panels (2 bytes a weight), the Q8_0 blocks (34 per 32), float32 norms
    bf16_weights = 49152 * 256 * 2 + 2 * (256 * (256 + 2 * 128) + 256 * 256 + 256 * 256)
    q8_weights = 2 * 2 * 256 * 256 // 32 * 34
    assert llm.weight_bytes < 1.1 * (2 * bf16_weights + q8_weights)  # float32 would be ~2x the bf16 part

    prompts = [[1, 400, 3000, 77, 12000, 5], [1, 9, 9, 9], list(range(100, 140))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    handles = _bf16_inputs(oracle)
    try:
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 10)
    finally:
        for handle in handles:
            handle.remove()


def test_a_type_nothing_dequantizes_is_a_value_error(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Q8_K (llama.cpp's activation type) has no kernel and gguf cannot dequantize it: refused by name."""
    from pagedllm.loader.gguf_loader import GGUFWeights, open_reader, read_config

    out = os.path.join(tmp_path_factory.mktemp("gguf-q8k"), "q8k.gguf")
    writer = GGUFWriter(out, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_context_length(64)
    writer.add_vocab_size(64)
    _, size = GGML_QUANT_SIZES[Q.Q8_K]
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((256, size), np.uint8), raw_dtype=Q.Q8_K)
    finish(writer)
    weights = GGUFWeights(out, read_config(open_reader(out)))
    with pytest.raises(ValueError, match="'blk.0.ffn_down.weight' is of type Q8_K"):
        list(weights)
