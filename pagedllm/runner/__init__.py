"""Model execution: loading the model, the KV cache, running steps and sampling (attention backends are layers/)."""
