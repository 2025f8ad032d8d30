"""Anthropic's Messages API on ``pagedllm serve`` (what Claude Code speaks), on the chat route's machinery.

    protocol.py          -- the request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``)
    convert.py           -- an Anthropic request as the chat completions request it means
    content_blocks.py    -- the reply's deltas as Anthropic content blocks and stream events
    errors.py            -- every error answer on these routes in Anthropic's shape
    serving_messages.py  -- the handler and ``add_messages_routes`` (one line in ``api_server.py``)
"""
