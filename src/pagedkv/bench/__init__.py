"""Block-manager benchmark suite (no torch): ``python -m pagedkv.bench --help``.

- :mod:`pagedkv.bench.workloads`: the workloads and the deterministic fake model;
- :mod:`pagedkv.bench.harness`: runs them through pagedkv and the anchors, timing the block-manager calls;
- :mod:`pagedkv.bench.report`: text tables, ratios and PNG charts;
- :mod:`pagedkv.bench.anchors`: adapters of other block managers;
- :mod:`pagedkv.bench.ablation`: ablation of the decode hot path.
"""
