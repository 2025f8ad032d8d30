"""The OpenAI-compatible server (``pagedllm serve``); see ``api_server.py`` for its parts."""
