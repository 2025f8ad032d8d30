"""Speculative decoding: draft proposers (n-gram, suffix trees, a draft model's engine) and the
per-sequence policy and cost model (no torch here; the runner verifies)."""
