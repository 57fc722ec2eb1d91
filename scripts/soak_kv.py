"""Soak the KV-content model (tests/kv_model.py): many managers, one after the other, until a step count or a
duration is reached; prints the steps run and the violations found (with the first messages) and exits 1 on any.

    PYTHONPATH=src python scripts/soak_kv.py --steps 1000000 --seed 0
    PYTHONPATH=src python scripts/soak_kv.py --seconds 600 --seed 1000 --steps-per-manager 2000

Each manager gets a configuration drawn from its seed (seed, seed + 1, ...): pool sizes, block size, prefix
caching, the CPU tier, sliding window, lookahead, KV events. ``--hybrid`` runs HybridBlockManagers (KV cache
groups: full attention and sliding windows) instead; ``--hybrid both`` alternates. Not run in CI
(tests/test_kv_content.py is).

    PYTHONPATH=src python scripts/soak_kv.py --seconds 600 --hybrid yes

``--small-path off`` builds every manager with the append's fast path off (``pagedkv.manager._small.SMALL_BATCH
= 0``: the vectorised plan and commit take every step).

``--external`` runs the external-KV model instead (tests/kv_external_model.py: loads into reserved blocks that
complete late, reordered, failing or after an abort; holds read by a second party; stores reading their blocks
late; docs/external-kv.md; ``--hybrid`` as above):

    PYTHONPATH=src python scripts/soak_kv.py --steps 20000 --external --steps-per-manager 500 --hybrid both
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import kv_external_model  # noqa: E402
import kv_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps in total (0: no limit)")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: no limit)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first manager")
    ap.add_argument("--steps-per-manager", type=int, default=1000)
    ap.add_argument("--check-every", type=int, default=10, help="check_invariants() every this many steps")
    ap.add_argument("--order", choices=("plan", "documented"), default="plan")
    ap.add_argument("--hybrid", choices=("no", "yes", "both"), default="no",
                    help="HybridBlockManager configurations (KV cache groups); both: every other manager")
    ap.add_argument("--external", action="store_true",
                    help="the external-KV model (loads, holds, stores) on BlockManagers")
    ap.add_argument("--small-path", choices=("on", "off"), default="on",
                    help="the append's fast path (the plain-Python step of small batches, manager/_small.py); off: "
                         "every manager built with SMALL_BATCH = 0 (the vectorised plan and commit only)")
    args = ap.parse_args(argv)
    if not args.steps and not args.seconds:
        ap.error("give --steps or --seconds")
    if args.small_path == "off":
        from pagedkv.manager import _small

        _small.SMALL_BATCH = 0
    t0 = time.perf_counter()
    steps = violations = managers = 0
    counts: dict = {}
    messages = []
    seed = args.seed
    while True:
        n = args.steps_per_manager if not args.steps else min(args.steps_per_manager, args.steps - steps)
        if n <= 0 or (args.seconds and time.perf_counter() - t0 >= args.seconds):
            break
        hybrid = args.hybrid == "yes" or (args.hybrid == "both" and seed % 2 == 1)
        if args.external:
            r = kv_external_model.run(seed, n, check_every=args.check_every, hybrid=hybrid)
        else:
            r = kv_model.run(seed, n, order=args.order, check_every=args.check_every, hybrid=hybrid)
        steps += r.steps
        managers += 1
        violations += r.violations
        for k, v in r.counts.items():
            counts[k] = counts.get(k, 0) + v
        if r.violations:
            messages.extend(f"seed {seed}: {m}" for m in r.messages[:3])
        seed += 1
    dt = time.perf_counter() - t0
    print(f"steps {steps} managers {managers} (seeds {args.seed}..{seed - 1}) violations {violations} "
          f"seconds {dt:.0f} ({steps / max(dt, 1e-9):.0f} steps/s)")
    print("calls: " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    for m in messages[:20]:
        print("  " + m)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
