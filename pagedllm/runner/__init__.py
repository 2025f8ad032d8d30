"""Model execution: the model runner and its KV cache, captured decode steps (``capture/``), the sampler,
the verification of draft tokens, and the tensor-parallel ranks (``tp_workers``, ``executor``). The
attention backends are layers (``layers/attention.py``)."""
