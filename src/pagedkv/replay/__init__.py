"""Replay production request traces (Mooncake format) through the prefix cache: ``pagedkv replay``.

Modules: :mod:`.trace` (parsing, token synthesis), :mod:`.sequence` and :mod:`.timed` (the two replay modes),
:mod:`.point` (one capacity point: the manager and its figures), :mod:`.tiered` (sequence mode with a disk and a
shared tier below the CPU tier: hits per tier), :mod:`.bound` (ceiling and Belady's optimum),
:mod:`.baseline` (the same LRU replay with an OrderedDict: the yardstick of the replay's speed),
:mod:`.report` (JSON, table, chart), :mod:`.__main__` (the command). Core only: numpy and xxhash, never torch.

Several replicas: :mod:`.cluster` (a trace routed over N managers with the router's index and policies from
:mod:`pagedkv.cluster`) and :mod:`.cluster_cli` (its command part); :mod:`.workload` (a multi-turn serving
workload scaled down from a trace, for ``pagedkv bench serve --trace``); :mod:`.command` (what the command parts
share).
"""

from .bound import NodeTrace, belady, ceiling, node_trace
from .point import CpuTierUnavailable, PointResult
from .sequence import replay_sequence
from .tiered import LruTier, replay_tiered
from .timed import ServiceModel, replay_timed
from .trace import Trace, TraceFormatError, load_trace, parse_trace_lines

__all__ = ["CpuTierUnavailable", "LruTier", "NodeTrace", "PointResult", "ServiceModel", "Trace", "TraceFormatError",
           "belady", "ceiling", "load_trace", "node_trace", "parse_trace_lines", "replay_sequence", "replay_tiered",
           "replay_timed"]
