"""One capacity point of a replay: building the manager and collecting its figures.

The CPU tier of the prefix cache (``BlockManager(..., cpu_prefix_cache=True)``) plugs in here: :func:`make_manager`
asks for it only when the build's BlockManager accepts the keyword, and :func:`tier_figures` reads the tier's
counters from the manager's ``stats`` under the names listed in ``_TIER_FIELDS`` (absent fields read as None).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field

from ..errors import InvalidArgumentError

__all__ = ["CpuTierUnavailable", "PointResult", "make_manager", "tier_figures"]


class CpuTierUnavailable(InvalidArgumentError):
    """A CPU capacity was asked for but this build's BlockManager has no CPU tier of the prefix cache."""


# PointResult field -> candidate names in the manager's stats (first present wins)
_TIER_FIELDS = {
    "cpu_hit_tokens": ("cpu_hit_tokens", "prefix_cpu_hit_tokens"),
    "demotions": ("demotions", "cpu_demotions"),
    "promotions": ("promotions", "cpu_promotions"),
}


@dataclass
class PointResult:
    """Figures of one replay at one capacity. Hit rates are fractions of all prompt tokens of the replayed
    requests (skipped ones excluded); ``hit_tokens`` sums what allocate returned."""

    impl: str
    mode: str
    capacity_tokens: int
    cpu_capacity_tokens: int
    block_size: int
    requests: int = 0  #: requests replayed
    skipped: int = 0  #: requests longer than the pool (never replayed)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    cpu_hit_tokens: int | None = None  #: None: no CPU tier
    evictions: int | None = None
    demotions: int | None = None
    promotions: int | None = None
    seconds: float = 0.0  #: replay time (trace parsing excluded)
    cpu_seconds: float | None = None  #: the same in the process's CPU time (sequence mode; steadier when shared)
    bound: float | None = None  #: Belady's hit rate at this capacity (with --bound)
    extra: dict = field(default_factory=dict)  #: mode-specific figures (timed mode: preemptions, ...)
    disk_capacity_tokens: int = 0  #: the disk tier below the CPU tier (pagedkv.replay.tiered); 0: none
    shared_capacity_tokens: int = 0  #: the shared tier below the disk tier; 0: none
    disk_hit_tokens: int | None = None  #: prompt tokens loaded from the disk tier (None: no disk tier)
    shared_hit_tokens: int | None = None  #: prompt tokens loaded from the shared tier (None: no shared tier)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def cpu_hit_rate(self) -> float:
        return (self.cpu_hit_tokens or 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def disk_hit_rate(self) -> float:
        return (self.disk_hit_tokens or 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def shared_hit_rate(self) -> float:
        return (self.shared_hit_tokens or 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_hit_rate(self) -> float:
        return self.hit_rate - self.cpu_hit_rate - self.disk_hit_rate - self.shared_hit_rate

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, gpu_hit_rate=self.gpu_hit_rate, cpu_hit_rate=self.cpu_hit_rate)
        if self.disk_hit_tokens is not None or self.shared_hit_tokens is not None:
            d.update(disk_hit_rate=self.disk_hit_rate, shared_hit_rate=self.shared_hit_rate)
        return d


def setting(bm, name: str, default=None):
    """A manager's construction setting: ``bm.config.<name>`` on a pagedkv BlockManager, else the attribute of that
    name (a benchmark adapter of another system), else ``default``. O(1)."""
    config = getattr(type(bm), "config", None)
    return getattr(bm.config, name) if isinstance(config, property) else getattr(bm, name, default)


def all_or_nothing(cls) -> bool:
    """Whether ``cls``'s decode_step is all-or-nothing for the batch: its ``atomic_append`` flag where it has one,
    else True for pagedkv's BlockManager (it has ``config``; every step of it is all or nothing)."""
    flag = getattr(cls, "atomic_append", None)  # (a class that says so, a subclass of BlockManager included)
    return bool(flag) if flag is not None else isinstance(getattr(cls, "config", None), property)


def make_manager(cls, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0, watermark: float = 0.0,
                 eviction_policy: str = "lru", **options):
    """``cls(num_gpu_blocks, block_size, enable_prefix_caching=True, ...)`` with the CPU tier when
    ``num_cpu_blocks`` > 0 and the eviction policy when not ``"lru"`` (``options``: more keywords for ``cls``, e.g.
    ``enable_kv_events=True``). Raises CpuTierUnavailable when ``cls`` has no ``cpu_prefix_cache`` keyword,
    InvalidArgumentError when it has no ``eviction_policy`` one."""
    kw: dict = {"enable_prefix_caching": True, "watermark": watermark, **options}
    if eviction_policy != "lru":
        try:
            params = inspect.signature(cls).parameters
        except (TypeError, ValueError):  # pragma: no cover - builtins
            params = {}
        if "eviction_policy" not in params:
            raise InvalidArgumentError(f"--eviction-policy {eviction_policy}: {getattr(cls, '__name__', cls)} has "
                                       f"no eviction_policy option")
        kw["eviction_policy"] = eviction_policy
    if num_cpu_blocks:
        try:
            params = inspect.signature(cls).parameters
        except (TypeError, ValueError):  # pragma: no cover - builtins
            params = {}
        if "cpu_prefix_cache" not in params:
            raise CpuTierUnavailable(
                f"--cpu-capacity: the CPU tier of the prefix cache is not available in this build "
                f"({getattr(cls, '__name__', cls)} has no cpu_prefix_cache option)")
        kw.update(num_cpu_blocks=num_cpu_blocks, cpu_prefix_cache=True)
    return cls(num_gpu_blocks, block_size, **kw)


def tier_figures(stats: object, tier: bool = True) -> dict:
    """``{"evictions", "cpu_hit_tokens", "demotions", "promotions"}`` from a manager's ``stats`` (a NamedTuple
    or a dict); a counter the manager does not keep, or any tier counter when ``tier`` is False, reads as None."""
    get = stats.get if isinstance(stats, dict) else (lambda k, d=None: getattr(stats, k, d))
    out = {"evictions": get("evictions", None)}
    for name, keys in _TIER_FIELDS.items():
        out[name] = next((int(get(k)) for k in keys if get(k, None) is not None), None) if tier else None
    if out["evictions"] is not None:
        out["evictions"] = int(out["evictions"])
    return out
