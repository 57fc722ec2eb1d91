"""Hypothesis stateful machine over external KV (docs/external-kv.md): hypothesis picks the order of the calls of
each step (admissions with external tokens, decodes, frees and aborts, holds, store plans) and their random
parameters, and shrinks a failing run to a short one; the KV-content model (tests/kv_external_model.py)
executes each step as an engine does (transfers completing late, reordered, failing; the copy plan; the
forward; holds read by a second party; stores reading their blocks late) and checks every running sequence's
KV. check_invariants after every rule, and the typed errors of bad reports leave the manager unchanged. Both
managers: BlockManager and HybridBlockManager (KV cache groups).

More examples: PAGEDKV_STATEFUL_EXAMPLES=2000 pytest tests/test_external_stateful.py
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kv_external_model
from pagedkv.errors import InvalidArgumentError, SequenceStateError, UnknownHoldError, UnknownSequenceError, \
    UnknownStoreError

EXAMPLES = int(os.environ.get("PAGEDKV_STATEFUL_EXAMPLES", "60"))
SEEDS = st.integers(0, 2**32 - 1)


def state(bm) -> tuple:
    return (bm.num_free_gpu_blocks, bm.stats.num_cached_blocks, bm.seq_ids, bm.external.loading_seq_ids, bm.external.parked_seq_ids,
            bm.external.holds, bm.external.pending_stores, {s: bm.block_table(s).tolist() for s in bm.seq_ids})


class ExternalMachine(RuleBasedStateMachine):
    @initialize(seed=SEEDS, hybrid=st.booleans())
    def start(self, seed, hybrid):
        self.m = kv_external_model.ExternalModel(seed, hybrid=hybrid)
        self.m.begin_step()

    def _with(self, seed):
        self.m.rng = random.Random(seed)

    @rule(seed=SEEDS)
    def admit(self, seed):
        self._with(seed)
        self.m.admit()

    @rule(seed=SEEDS)
    def decode(self, seed):
        self._with(seed)
        self.m.decode()

    @rule(seed=SEEDS)
    def free(self, seed):
        self._with(seed)
        self.m.free_one()

    @rule(seed=SEEDS)
    def hold(self, seed):
        self._with(seed)
        self.m.hold_one()

    @rule()
    def store(self):
        self.m.take_store()

    @rule(seed=SEEDS)
    def end_step(self, seed):
        self._with(seed)
        self.m.end_step()
        self.m.begin_step()

    @rule(data=st.data())
    def bad_calls(self, data):
        """Bad reports and ids: a typed error, nothing changed."""
        bm = self.m.bm
        before = state(bm)
        live = [s for s in bm.seq_ids if s not in bm.external.loading_seq_ids]
        choices = [("finish", "nope"), ("hold", 10**9), ("store", 10**9)]
        if live:
            choices.append(("finish", data.draw(st.sampled_from(live))))
        for s in bm.external.loading_seq_ids:
            choices.append(("fail_bad", s))
            choices.append(("step", s))
        kind, x = data.draw(st.sampled_from(choices))
        if kind == "finish":
            with pytest.raises((UnknownSequenceError, SequenceStateError)):
                bm.external.finish_external(done=[x])
        elif kind == "hold":
            with pytest.raises(UnknownHoldError):
                bm.external.release_hold(x)
        elif kind == "store":
            with pytest.raises(UnknownStoreError):
                bm.external.complete_store(x)
        elif kind == "fail_bad":
            with pytest.raises(InvalidArgumentError):
                bm.external.finish_external(failed={x: bm.external.external_blocks(x).num_tokens})
        else:
            with pytest.raises(SequenceStateError):
                bm.decode_step([x], [1])
        assert state(bm) == before

    @invariant()
    def audit(self):
        self.m.bm.check_invariants()

    def teardown(self):
        if hasattr(self, "m"):
            self.m.end_step()
            self.m.drain()


ExternalMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                             suppress_health_check=list(HealthCheck))
TestExternalMachine = ExternalMachine.TestCase
