"""Building blocks the model families are written from: attention, MLP, norms, RoPE, the decoder; linear methods."""
