"""The KV-content model of external KV (tests/kv_external_model.py), CI-sized: loads completing in any order,
failing or aborted while in flight, holds read by a second party, stores reading their blocks late, swaps and
the CPU tier; every running sequence reads back its own KV (every group's) after every step, check_invariants
after every step. BlockManager and HybridBlockManager (KV cache groups: full attention and sliding windows)."""

import pytest

import kv_external_model

COUNTED = ("loads", "loads_done", "loads_failed", "aborted_loading", "holds", "held_on_free", "holds_read",
           "swapped_out", "swapped_in", "holds_expired", "stores_planned", "stores_done", "admitted",
           "stores_planned_cpu")


@pytest.mark.parametrize("hybrid", [False, True], ids=["manager", "hybrid"])
@pytest.mark.parametrize("seed", range(10))
def test_external_kv_content(seed, hybrid):
    r = kv_external_model.run(seed, 150, hybrid=hybrid)
    assert r.violations == 0, r.messages
    assert r.steps == 150


@pytest.mark.parametrize("hybrid", [False, True], ids=["manager", "hybrid"])
def test_the_model_exercises_every_path(hybrid):
    counts: dict = {}
    for seed in range(10):
        for k, v in kv_external_model.run(seed, 150, hybrid=hybrid).counts.items():
            counts[k] = counts.get(k, 0) + v
    for k in COUNTED + (("loads_window_only",) if hybrid else ()):
        assert counts.get(k, 0) > 0, (k, counts)
