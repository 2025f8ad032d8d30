"""A tiny random-weight model that speaks harmony's vocabulary, for gpt-oss format tests.

No gpt-oss tokenizer can be downloaded here, so the test builds one the way
gpt-oss's own was made: o200k_base's ranks (``pagedllm.harmony.vocab``,
checked against the published hash) converted by transformers'
``TikTokenConverter``, then the 1,090 o200k_harmony special tokens
(``<|startoftext|>`` 199998 ... ``<|return|>`` 200002, ``<|channel|>`` 200005 ...,
up to 201087) in openai-harmony's own order, so token ids equal harmony's.
The model is a 2-layer Llama with that vocabulary (tied embeddings, 64 wide);
its chat template is a short harmony one, which is what makes the server
pick the ``gpt_oss`` parser and openai-harmony's renderer.
"""

from __future__ import annotations

from pathlib import Path

# o200k_base's pre-tokenizer pattern (tiktoken's, as openai-harmony's encoding uses)
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RANKS = 199998
VOCAB_SIZE = 201088
# a harmony-shaped template: only its markers matter (the server renders with openai-harmony)
HARMONY_TEMPLATE = (
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant<|channel|>{%- endif %}"
)


def save_harmony_tokenizer(path: Path) -> None:
    """Write an o200k_harmony ``tokenizer.json`` (+ config) into ``path``."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from pagedllm.harmony.vocab import VOCAB_FILE, ensure_vocab, harmony_encoding

    backend = TikTokenConverter(vocab_file=str(ensure_vocab() / VOCAB_FILE), pattern=O200K_PATTERN).converted()
    encoding = harmony_encoding()
    specials = [encoding.decode([i]) for i in range(NUM_RANKS, VOCAB_SIZE)]
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(path)


def save_tiny_harmony_model(path: Path) -> str:
    """The tiny Llama with the harmony tokenizer, in ``path``; its folder."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    save_harmony_tokenizer(path)
    stops = [200002, 200012]  # <|return|>, <|call|>: gpt-oss's generation_config stops there
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=NUM_RANKS, eos_token_id=stops,
    )
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=NUM_RANKS, eos_token_id=stops).save_pretrained(path)
    return str(path)
