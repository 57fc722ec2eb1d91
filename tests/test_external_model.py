"""The KV-content model of external KV (tests/kv_external_model.py), CI-sized: loads completing in any order,
failing or aborted while in flight, holds read by a second party, stores reading their blocks late; every
running sequence reads back its own KV after every step, check_invariants after every step."""

import pytest

import kv_external_model


@pytest.mark.parametrize("seed", range(12))
def test_external_kv_content(seed):
    r = kv_external_model.run(seed, 150)
    assert r.violations == 0, r.messages
    assert r.steps == 150


def test_the_model_exercises_every_path():
    counts: dict = {}
    for seed in range(12):
        for k, v in kv_external_model.run(seed, 150).counts.items():
            counts[k] = counts.get(k, 0) + v
    for k in ("loads", "loads_done", "loads_failed", "aborted_loading", "holds", "held_on_free", "holds_read",
              "holds_expired", "stores_planned", "stores_done", "admitted"):
        assert counts.get(k, 0) > 0, (k, counts)
