"""How linear and embedding layers store and multiply their weights: one ``QuantConfig`` per load
(``quant_config.py``) hands every layer its method: our packed float32 / bfloat16 panels
(``packed_linear.py``), oneDNN's (``onednn_linear.py``), torch's bfloat16 matmul (``bf16_linear.py``),
weight-only int8 / int4 blocks (``quantized_linear.py``) or a GGUF file's blocks as stored
(``gguf_linear.py``). The layer classes and the method interface are ``layers/linear.py``."""
