"""Before / after in one process: the sequence replay with another checkout's BlockManager and with this tree's.

    PYTHONPATH=src .venv/bin/python benchmarks/replay_ab.py --before ../other-checkout/src [--limit N]
        [--repeats 3] [--json OUT]

``--before`` is the ``src`` folder of another checkout (e.g. main in a git worktree): its ``pagedkv`` package is
copied to a temporary folder and imported as ``pagedkv_before``. Per repeat, alternating in this process: the LRU
baseline (:func:`pagedkv.replay.baseline.lru_replay`), the replay with the other checkout's manager, the replay
with this tree's manager, all through this tree's :func:`pagedkv.replay.replay_sequence` driver; all three must
report the same hits and evictions (asserted). Prints each one's CPU seconds and the ratios to the baseline
(CPU time: see ``benchmarks/replay_speed.py``). The trace and capacity are those of ``replay_speed.py``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pagedkv.manager import BlockManager
from pagedkv.replay import load_trace, replay_sequence
from pagedkv.replay.__main__ import parse_tokens
from pagedkv.replay.baseline import lru_replay

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_speed import _default_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, metavar="SRC", help="the src folder of another checkout")
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--capacity", type=parse_tokens, default=1_000_000, metavar="TOKENS")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=None, metavar="N", help="the first N requests only")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    a = ap.parse_args(argv)
    path = a.trace or _default_trace()
    if path is None or not Path(path).is_file():
        ap.error("no trace: pass --trace FILE (../shared/data/mooncake/conversation_trace.jsonl)")
    if not any((a.before / "pagedkv" / f).is_file() for f in ("manager.py", "manager/core.py")):
        ap.error(f"{a.before} has no pagedkv package")
    tmp = tempfile.mkdtemp()
    shutil.copytree(a.before / "pagedkv", Path(tmp) / "pagedkv_before")
    sys.path.insert(0, tmp)
    Before = importlib.import_module("pagedkv_before.manager").BlockManager
    tr = load_trace(path, a.limit)
    cap = a.capacity
    for cls in (Before, BlockManager):
        replay_sequence(tr.limit(50), cap, manager_cls=cls)
    runs = []
    for rep in range(a.repeats):
        gc.collect()
        b = lru_replay(tr, cap)
        gc.collect()
        x = replay_sequence(tr, cap, manager_cls=Before)
        gc.collect()
        y = replay_sequence(tr, cap, manager_cls=BlockManager)
        assert (x.hit_tokens, x.evictions) == (y.hit_tokens, y.evictions) == (b.hit_tokens, b.evictions)
        r = {"baseline_cpu_s": b.cpu_seconds, "before_cpu_s": x.cpu_seconds, "after_cpu_s": y.cpu_seconds,
             "ratio_before": x.cpu_seconds / b.cpu_seconds, "ratio_after": y.cpu_seconds / b.cpu_seconds,
             "after_over_before": y.cpu_seconds / x.cpu_seconds}
        runs.append(r)
        print(f"repeat {rep + 1}: CPU s baseline {b.cpu_seconds:.2f}, before {x.cpu_seconds:.2f} "
              f"({r['ratio_before']:.2f}x), after {y.cpu_seconds:.2f} ({r['ratio_after']:.2f}x); after / before "
              f"{r['after_over_before']:.3f}; hits identical", flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in ("ratio_before", "ratio_after", "after_over_before")}
    print(f"median of {a.repeats}: before {med['ratio_before']:.2f}x, after {med['ratio_after']:.2f}x the baseline "
          f"(after / before {med['after_over_before']:.3f})")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "trace": Path(path).name, "requests": len(tr), "capacity_tokens": cap, "block_size": 16,
            "hit_tokens": y.hit_tokens, "evictions": y.evictions, "before": str(a.before),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "median": med, "runs": runs},
            indent=1) + "\n")
        print(f"wrote {a.json}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
