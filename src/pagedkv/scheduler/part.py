"""What every scheduling part works on: the settings, the queues (with their stats) and the block calls."""

from __future__ import annotations

from .calls import BlockCalls
from .state import Config, Queues


class Part:
    """Base of the scheduler's parts (:class:`~pagedkv.scheduler.preempt.Preemptor`, ``Decoder``, ``Chunker``,
    ``Admitter``, ``Updater``): holds the objects given at construction, nothing else. O(1)."""

    __slots__ = ("cfg", "q", "calls", "stats")

    def __init__(self, cfg: Config, q: Queues, calls: BlockCalls) -> None:
        self.cfg = cfg
        self.q = q
        self.calls = calls
        self.stats = q.stats
