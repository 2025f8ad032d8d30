"""Engine clients: what drives an ``LLMEngine`` for a server, behind ``engine/protocol.py``'s ``EngineClient``.

``async_engine.py`` runs one engine on a thread of this process;
``data_parallel/`` runs N engine processes behind a prefix-aware router.
``metrics.py`` (Prometheus figures the clients record) and
``kv_publisher.py`` (/kv snapshots of an engine) go with them. Imports
``engine/`` and below, never ``entrypoints/``: the server imports the
clients, and maps their errors to HTTP answers itself.
"""
