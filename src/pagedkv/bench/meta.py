"""The machine and the versions a benchmark result records (shared by every bench command: the suite, ``sweep``,
``single``), so that the commands need not import each other.
"""

from __future__ import annotations

import os
import platform

__all__ = ["machine", "versions"]


def machine() -> dict:
    """Platform, architecture, processor, CPU count and Python implementation of this machine."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python_implementation": platform.python_implementation(),
    }


def versions() -> dict:
    """Python, numpy and pagedkv versions (a result adds its implementations' own)."""
    import numpy

    import pagedkv

    return {"python": platform.python_version(), "numpy": numpy.__version__, "pagedkv": pagedkv.__version__}
