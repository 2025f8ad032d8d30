"""Tiny Llama checkpoints written as GGUF files by the tests with the ``gguf`` package's writer.

Tensor names, metadata keys and the Q/K row order are llama.cpp's (as its
converter writes a Llama), so the loader reads these files as it reads users'
files; what each test stores per tensor (a type, hand-made blocks) stays in the test.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFWriter

# Hugging Face's per-layer names -> llama.cpp's (``blk.N.`` prefixed)
LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of the Hugging Face Llama tensor ``hf_name``."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def llama_writer(cfg, path: str, head_dim: int | None = None) -> GGUFWriter:  # noqa: ANN001
    """A writer for a ``llama`` file holding transformers ``LlamaConfig`` ``cfg``'s metadata (and the head size
    as key/value lengths where given); the caller adds the tensors and writes the file (``finish``)."""
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(cfg.eos_token_id)
    return writer


def rope_order(w: np.ndarray, num_heads: int) -> np.ndarray:
    """q or k rows of ``num_heads`` heads from Hugging Face's halves to llama.cpp's interleaved RoPE order
    (the converter's permutation, which the loader undoes)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def finish(writer: GGUFWriter) -> None:
    """Write the header, metadata and tensors added to ``writer``, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
