"""``--data-parallel-size N``: N engine processes behind one engine client (``client.DataParallelEngine``)."""
