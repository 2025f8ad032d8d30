"""Captured decode steps: one FX trace of the model's decode forward (``decode_graph``), replayed per step
(``captured_decode``), its kernels run back to back as native step programs (``step_program``)."""
