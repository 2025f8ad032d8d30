"""Building blocks the models are written from: linear methods, attention backends, norms, rotary embeddings, activations."""
