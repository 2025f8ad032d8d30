"""Bookkeeping (sequence, block manager, scheduler) and the engine loop."""
