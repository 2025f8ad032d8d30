"""Speculative decoding: draft proposers and the per-sequence policy (no torch here; the runner verifies)."""
