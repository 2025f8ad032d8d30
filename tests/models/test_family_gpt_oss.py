"""gpt-oss (``GptOssForCausalLM``, GGUF ``gpt-oss``) against transformers on the same tiny random weights.

A tiny random checkpoint of transformers' own ``GptOssConfig``: 8 experts,
2 per token, hidden 64, experts of 32, two layers (the first sliding over a
window of 8 keys, the second full), YaRN as gpt-oss configures it. The weights
are drawn wide (``initializer_range`` 0.2), and the sinks, every bias and the
norms at random, so that the router's choices differ from token to token and
a wrong sink, bias, clamp, window or interleaving changes the greedy tokens.
Prompts of 33 tokens and generations of 12 run well past the window.

The folder (experts stacked, gate and up interleaved by columns) runs with
the native kernels on float32 activations: transformers' greedy tokens and
logprobs within ``LOGPROB_TOL`` (only summation order differs). The files of
llama.cpp's own converter (F32; F16, against transformers on the weights the
converter rounded) give the same, and so does the converter's file of an
MXFP4 folder made from the same weights (the released checkpoints' format),
its experts kept in MXFP4 blocks, against transformers on the blocks' values.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import MoEBlock
from pagedllm.loader import load_model_config
from pagedllm.models.gpt_oss import GptOssForCausalLM

LOGPROB_TOL = 1e-4
F16_LOGPROB_TOL = 1e-3
GENERATED = 12
WINDOW = 8
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32")
NUM_EXPERTS, TOP_K, NUM_HEADS = 8, 2, 4


def _tiny_config():  # noqa: ANN202
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=49152, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=NUM_HEADS, num_key_value_heads=2, head_dim=16,
                        num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, sliding_window=WINDOW,
                        max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save_tiny_gpt_oss(path: Path, tokenizer) -> str:  # noqa: ANN001
    """A tiny random gpt-oss saved as a safetensors folder at ``path``: sinks in [-1, 3), biases N(0, 0.2), norms
    in [0.5, 1.5), the experts' gate/up weights wide enough for the SwiGLU's clamps to act."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_tiny_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                param.uniform_(-1.0, 3.0)
            elif "bias" in name:
                param.normal_(0.0, 0.2)
            elif name.endswith("gate_up_proj"):
                param.mul_(4.0)  # gate and up of std ~6: the clamps at 7 act on a good share of them
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """The tiny random gpt-oss of ``save_tiny_gpt_oss``."""
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"), smollm_tokenizer)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (33, 7)]


def _hf(path: str, round_matrices_to_f16: bool = False):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if round_matrices_to_f16:  # the converter writes matrices (experts included) in the outtype, vectors in F32
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if p.dim() >= 2 and not name.endswith(("router.weight", "_bias")):
                    p.copy_(p.half().float())
    return hf


def _max_logprob_error(hf, out) -> float:  # noqa: ANN001
    """Largest gap between pagedllm's logprobs (prompt and output, top 5 and chosen) and transformers'."""
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    prompt_len = len(out.prompt_token_ids)
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    return max(abs(lp.logprob - float(want[row, token])) for row, lps in rows for token, lp in lps.items())


def _check_against_transformers(llm: LLM, hf, prompts: list[list[int]], tol: float = LOGPROB_TOL) -> None:  # noqa: ANN001
    """Greedy tokens equal transformers'; every reported logprob within ``tol`` of its."""
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(hf, out) < tol


def test_gpt_oss_folder_matches_transformers(gpt_oss_dir: str) -> None:
    """The folder's model on the native kernels: transformers' tokens and logprobs past the window."""
    cfg = load_model_config(gpt_oss_dir)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_act) == (
        "gpt_oss", NUM_EXPERTS, TOP_K, "swiglu_oai")
    assert (cfg.sliding_windows, cfg.attention_sinks, cfg.attention_bias) == ((WINDOW, None), True, True)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    llm = LLM(gpt_oss_dir, **ENGINE)
    model = llm.llm_engine.model_runner.model
    assert isinstance(model, GptOssForCausalLM)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, MoEBlock) and layer.mlp.experts.gate_up.bias is not None
    assert layer.self_attn.sinks is not None and layer.self_attn.sliding_window == WINDOW
    assert not layer.self_attn.kv_transform.shift_keys  # an int4 cache's shift would move scores, not sinks
    assert model.model.layers[1].self_attn.sliding_window is None
    _check_against_transformers(llm, _hf(gpt_oss_dir), _prompts(5))
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


@pytest.mark.parametrize(("outtype", "tol"), [
    ("f32", LOGPROB_TOL), pytest.param("f16", F16_LOGPROB_TOL, marks=pytest.mark.slow)])
def test_gpt_oss_gguf_from_llama_cpp_converter_matches_transformers(
    gpt_oss_dir: str, gguf_converter, tmp_path_factory: pytest.TempPathFactory, outtype: str, tol: float,  # noqa: ANN001
) -> None:
    """llama.cpp's converter splits the interleaved gate/up into ffn_gate_exps / ffn_up_exps and writes the
    sinks, biases and window: the file gives transformers' tokens (F16: on the weights it rounded)."""
    path = str(tmp_path_factory.mktemp("gpt-oss-gguf") / f"tiny-gpt-oss-{outtype}.gguf")
    gguf_converter.convert(gpt_oss_dir, outtype, path)
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.num_experts, cfg.attention_sinks, cfg.sliding_windows) == (
        "gpt-oss", NUM_EXPERTS, True, (WINDOW, None))
    llm = LLM(path, **ENGINE)
    _check_against_transformers(llm, _hf(gpt_oss_dir, round_matrices_to_f16=outtype == "f16"), _prompts(6), tol)



def test_the_checkpoints_sinks_window_and_clamp_change_transformers_outputs(gpt_oss_dir: str) -> None:
    """What the tests above compare would show a dropped sink, window or clamp: each changes the logprobs of
    the prompts by far more than ``LOGPROB_TOL``."""
    prompt = torch.tensor([_prompts(5)[0]])

    def logprobs(hf) -> torch.Tensor:  # noqa: ANN001
        with torch.inference_mode():
            return torch.log_softmax(hf(input_ids=prompt).logits[0].double(), dim=-1)

    want = logprobs(_hf(gpt_oss_dir))
    no_sinks = _hf(gpt_oss_dir)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    no_window = _hf(gpt_oss_dir)
    no_window.config.sliding_window = 10_000
    unclamped = _hf(gpt_oss_dir)
    for layer in unclamped.model.layers:
        layer.mlp.experts.limit = float("inf")
    gaps = [float((logprobs(changed) - want).abs().max()) for changed in (no_sinks, no_window, unclamped)]
    assert min(gaps) > 100 * LOGPROB_TOL, gaps


# the 16 values of an FP4 (E2M1) nibble, as the MXFP4 format defines them: sign bit 3, then 0 .. 6
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``w`` ``[..., rows, cols]`` in MXFP4 as gpt-oss's checkpoints store it: (blocks uint8 ``[..., rows,
    cols / 32, 16]``, element 2i in the low nibble of byte i; scales uint8 ``[..., rows, cols / 32]``, E8M0 with
    bias 127; the values they hold, float32 ``w``'s shape). Each group of 32 takes the power of two that puts
    its largest magnitude within 6, each value the nearest E2M1 value."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    nibbles = ((groups / 2.0**exponent).unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)
    values = (E2M1[nibbles.long()] * 2.0**exponent).reshape(w.shape)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8), values


@pytest.fixture(scope="session")
def gpt_oss_mxfp4(gpt_oss_dir: str, tmp_path_factory: pytest.TempPathFactory, gguf_converter) -> tuple[str, str]:  # noqa: ANN001
    """(a folder whose experts are MXFP4 blocks, as the released checkpoints; its GGUF file from llama.cpp's
    converter, which keeps them in blocks), and beside the folder ``oracle/``: the float model holding the
    values the blocks hold, for transformers."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    folder, oracle = root / "mxfp4", root / "oracle"
    shutil.copytree(gpt_oss_dir, folder)
    shutil.copytree(gpt_oss_dir, oracle)
    tensors = load_file(str(folder / "model.safetensors"))
    floats = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(name).transpose(1, 2).contiguous()  # [experts, out, in], as the blocks hold rows
        blocks, scales, values = _mxfp4(rows)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks.contiguous(), scales.contiguous()
        floats[name] = values.transpose(1, 2).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    path = str(root / "tiny-gpt-oss-mxfp4.gguf")
    gguf_converter.convert(str(folder), "f32", path)
    return str(folder), path


@pytest.mark.slow
def test_gpt_oss_mxfp4_gguf_keeps_the_experts_in_blocks(gpt_oss_mxfp4: tuple[str, str]) -> None:
    """The converter's file of an MXFP4 folder: the experts stay MXFP4 blocks (never widened to float) and, on
    float32 activations (``gguf_activations``: the blocks' products in float), give transformers' tokens and
    logprobs on the values the blocks hold; the folder itself is refused, naming the converter."""
    from pathlib import Path

    folder, path = gpt_oss_mxfp4
    llm = LLM(path, gguf_activations="float32", **ENGINE)
    experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
    for layer in (experts.gate_up, experts.down):
        assert layer.quant_method.ggml_type == 39  # MXFP4, in the file's order
        assert not any(t.is_floating_point() and t.numel() >= layer.in_features * layer.out_features
                       for t in (*layer.parameters(), *layer.buffers()))
    _check_against_transformers(llm, _hf(str(Path(folder).parent / "oracle")), _prompts(8))
    with pytest.raises(ValueError, match="convert_hf_to_gguf"):
        LLM(folder, **ENGINE)


@pytest.mark.slow  # the MXFP4 file is converted in a subprocess (seconds)
def test_gpt_oss_mxfp4_decode_steps_are_captured_with_the_eager_bits(gpt_oss_mxfp4: tuple[str, str]) -> None:
    """The MXFP4 file's decode steps (the grouped op, the experts' biases added per pair, the top-k-then-softmax
    router, the clamped SwiGLU, sinks and the window) are traced and replayed: the eager model's tokens and
    logprobs bit for bit, a sequence's alike alone and among others, past the window; the expert-load
    counters as the eager steps count them. Without prefix caching: the first prompt's second run would
    prefill from its cached blocks, which moves a sinks model's logprobs in the last bits, eager or not."""
    _, path = gpt_oss_mxfp4
    prompts = [_prompts(9)[0], [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5)

    def run(llm: LLM) -> tuple[list, list]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        blocks = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, MoEBlock)]
        return ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
                [[*b.expert_tokens.tolist(), int(b.num_forwards)] for b in blocks])

    eager = LLM(path, **ENGINE, enable_prefix_caching=False, enforce_eager=True)
    want, want_counts = run(eager)
    del eager
    llm = LLM(path, **ENGINE, enable_prefix_caching=False, capture_min_decode_steps=0)
    got, got_counts = run(llm)
    captured = llm.llm_engine.model_runner.captured_decode
    assert captured.failed is None and captured.graphs
    assert got == want and got[0] == got[-1]
    assert got_counts == want_counts
    assert all(sum(c[:-1]) == TOP_K * sum(len(p) + GENERATED - 1 for p in (*prompts, prompts[0])) for c in got_counts)
