"""xgrammar, imported on the first constrained request rather than with this package."""

from __future__ import annotations

from typing import Any


def xgrammar() -> Any:  # noqa: ANN401 - the module
    """xgrammar, imported on the first constrained request: it pulls in torch and triton (~25 MiB resident,
    0.1 s) that an engine serving no constraint never needs."""
    import xgrammar as xgr

    return xgr
