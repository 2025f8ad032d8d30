"""The prefix cache on disk (``--kv-cache-dir``): full KV blocks kept in files across restarts.

``block_file.py`` is one file's bytes, ``fingerprint.py`` what a block's bits
depend on (its folder), ``store.py`` the folder itself: lookups, checked
reads, a background writer, the byte bound; ``open_store.py`` opens it for an
engine. Only ``fingerprint.py`` and ``open_store.py`` reach torch-importing modules:
the bookkeeping imports ``store.py`` alone. docs/disk-prefix-cache.md.
"""

