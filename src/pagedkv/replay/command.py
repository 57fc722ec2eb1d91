"""What the two command parts of ``pagedkv replay`` share (one manager: :mod:`pagedkv.replay.__main__`; several
replicas: :mod:`pagedkv.replay.cluster_cli`): the default capacities and the progress bar.
"""

from __future__ import annotations

import sys

__all__ = ["DEFAULT_CAPACITIES", "progress_bar"]

DEFAULT_CAPACITIES = (300_000, 1_000_000, 3_000_000, 10_000_000)


def progress_bar(total: int, disable: bool):
    """A tqdm bar of ``total`` requests on stderr, or None when disabled or tqdm is not installed."""
    if disable:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        return None
    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
