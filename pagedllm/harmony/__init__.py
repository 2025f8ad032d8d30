"""gpt-oss's harmony chat format, through OpenAI's ``openai-harmony`` package.

``vocab.py`` loads the harmony encoding without the network (its o200k_base
vocabulary file, written once from a PyPI package and checked against its
published hash); ``prompt.py`` renders OpenAI chat messages, function tools
and ``reasoning_effort`` into harmony prompt tokens. Reading the model's
output back into channels is the ``gpt_oss`` reasoning parser
(``entrypoints/openai/reasoning_parsers/gpt_oss.py``). No torch here.
"""
