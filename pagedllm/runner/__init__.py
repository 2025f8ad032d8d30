"""Model execution: the KV cache, attention backends and the sampler."""
