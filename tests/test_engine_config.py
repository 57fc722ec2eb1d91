"""The engine's options, declared once (pagedkv.engine.config): each field checked when its config is made, the
flat names mapped to the one config that owns them, the command-line options derived from the fields, and
``LLM.__init__`` kept to the common keywords plus the configs. Torch-free (the configs and the options are)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from pagedkv.engine.config import (CONFIG_CLASSES, CacheConfig, ModelRunConfig, SchedulerConfig, TierConfig,
                                   engine_configs)
from pagedkv.engine.options import add_engine_args
from pagedkv.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cls, field, bad", [
    (CacheConfig, "block_size", 0), (CacheConfig, "block_size", True), (CacheConfig, "num_gpu_blocks", 0),
    (CacheConfig, "num_cpu_blocks", -1), (CacheConfig, "kv_cache_gib", 0), (CacheConfig, "swap_space", -1.0),
    (CacheConfig, "enable_prefix_caching", 1), (CacheConfig, "sliding_window", 0),
    (CacheConfig, "eviction_policy", "fifo"), (CacheConfig, "pin_budget_blocks", -1),
    (SchedulerConfig, "max_num_seqs", 0), (SchedulerConfig, "max_num_batched_tokens", 0),
    (SchedulerConfig, "max_num_batched_tokens", 1.5), (SchedulerConfig, "long_prefill_token_threshold", -1),
    (SchedulerConfig, "preemption_mode", "drop"), (SchedulerConfig, "scheduling_policy", "lifo"),
    (SchedulerConfig, "num_lookahead_slots", -1), (ModelRunConfig, "threads", 0), (ModelRunConfig, "threads", "2"),
    (ModelRunConfig, "max_model_len", 0), (ModelRunConfig, "fast_lm_head", None),
    (TierConfig, "kv_store", "sometimes"), (TierConfig, "kv_load_max_ms_per_block", -1.0),
])
def test_a_bad_field_is_refused_by_name(cls, field, bad):
    with pytest.raises(InvalidArgumentError, match=field if field != "kv_store" else "kv_store"):
        cls(**{field: bad})


def test_cross_field_checks_within_one_config():
    with pytest.raises(InvalidArgumentError, match="swap_space"):
        CacheConfig(swap_space=1.0, num_cpu_blocks=4)  # give one of them
    with pytest.raises(InvalidArgumentError, match="kv_disk_gib needs kv_disk_dir"):
        TierConfig(kv_disk_gib=1.0)
    assert SchedulerConfig().token_budget == 512 and SchedulerConfig(enable_chunked_prefill=False).token_budget == 2048
    assert SchedulerConfig(max_num_batched_tokens=64).token_budget == 64
    assert not TierConfig().enabled and TierConfig(kv_shared="file:///x").enabled


def test_configs_are_frozen():
    c = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 4  # type: ignore[misc]


def test_engine_configs_maps_each_flat_name_to_its_one_config():
    names = [f.name for cls in CONFIG_CLASSES.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))  # a flat name belongs to one config
    got = engine_configs(max_num_seqs=3, eviction_policy="slru", threads=2, kv_shared="file:///d")
    assert got == {"scheduler_config": SchedulerConfig(max_num_seqs=3),
                   "cache_config": CacheConfig(eviction_policy="slru"), "run_config": ModelRunConfig(threads=2),
                   "tier_config": TierConfig(kv_shared="file:///d")}
    assert engine_configs() == {}
    with pytest.raises(TypeError, match="no engine option named 'max_seqs'"):
        engine_configs(max_seqs=3)
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        engine_configs(max_num_seqs=0)


def test_every_field_is_documented_and_the_options_come_from_the_fields():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    defaults = vars(p.parse_args([]))
    for cls in CONFIG_CLASSES.values():
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name} has no help"
            cli = f.metadata.get("cli", True)
            if cli is True:  # an option of that name, with the field's default and help
                assert defaults[f.name] == f.default, f.name
                action = next(a for a in p._actions if a.dest == f.name)
                assert action.help == f.metadata["help"]
                assert action.option_strings[0] == "--" + f.name.replace("_", "-")
            elif cli is False:
                assert f.name not in defaults
    assert defaults["no_prefix_caching"] is False and defaults["kv_store_policy"] is None  # (spelled by hand)
    args = p.parse_args(["--eviction-policy", "slru", "--no-quant-kernels", "--max-num-batched-tokens", "64"])
    assert (args.eviction_policy, args.quant_kernels, args.max_num_batched_tokens) == ("slru", False, 64)
    with pytest.raises(SystemExit):  # the field's choices
        p.parse_args(["--eviction-policy", "fifo"])


def test_llm_init_takes_the_common_keywords_and_the_configs():
    tree = ast.parse((ROOT / "src" / "pagedkv" / "engine" / "llm.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLM")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    params = [a.arg for a in init.args.args + init.args.kwonlyargs]
    assert len(params) <= 12 and init.args.kwarg is None and init.args.vararg is None, params
    assert {"cache_config", "scheduler_config", "run_config", "tier_config", "max_num_seqs",
            "block_size"} <= set(params)
