"""User-facing entry points: the CLI and the OpenAI-compatible server (``llm.py`` re-exports the offline ``LLM`` of ``engine/``)."""
