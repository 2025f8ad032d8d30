"""Bookkeeping (sequence, block manager, scheduler), the engine loop, and the offline ``LLM`` that drives it."""
