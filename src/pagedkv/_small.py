"""Placeholder: the plain-Python small-batch path (filled in below)."""

from __future__ import annotations


class _Small:
    """Mixin of :class:`pagedkv.BlockManager`: the append for small batches in plain Python."""
