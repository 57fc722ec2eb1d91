"""The engine's thread policy (pagedkv.engine.cpu): its logic on injected /proc readings, the explicit
settings that win over it, ``--threads`` in every engine command, and one OpenMP runtime in the process."""

from __future__ import annotations

import pytest

from pagedkv.engine import cpu as th
from pagedkv.errors import InvalidArgumentError
from pagedkv.engine.config import ModelRunConfig

STAT = "cpu  100 50 30 800 20 0 0 0 0 0\ncpu0 50 25 15 400 10 0 0 0 0 0\n"
SELF = "1234 (python (a) b) R 1 2 3 4 5 6 7 8 9 10 17 4 0 0 20 0 3 0 100\n"


def test_parse_proc_files():
    assert th.parse_proc_stat(STAT) == (180, 1000)  # busy: user + nice + system (idle and iowait excluded)
    assert th.parse_self_stat(SELF) == 21  # utime 17 + stime 4, after a command name with spaces and ')'
    with pytest.raises(ValueError):
        th.parse_proc_stat("intr 1 2 3")
    assert th.read_cpu_times() is None or th.read_cpu_times().total > 0
    assert th.parse_proc_stat(STAT, yield_nice=True) == (130, 1000)  # the nice column (50) yields to the engine


def test_niced_processes_yield_only_without_autogroup(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    on.write_text("1\n")
    off.write_text("0\n")
    assert th.nice_yields(str(off), own_nice=0) is True  # nice compared machine-wide: a niced process yields
    assert th.nice_yields(str(off), own_nice=-5) is True
    assert th.nice_yields(str(on), own_nice=0) is False  # autogroup: each session shares the CPU as a whole
    assert th.nice_yields(str(off), own_nice=10) is False  # our own time is in the nice column: count it all
    assert th.nice_yields(str(tmp_path / "absent"), own_nice=0) is True  # no autogroup in this kernel


def test_others_cores():
    a = th.CpuTimes(busy=0, total=0, own=0)
    assert th.others_cores(a, th.CpuTimes(100, 200, 0), 2) == 1.0  # half of 2 cores busy, none of it ours
    assert th.others_cores(a, th.CpuTimes(100, 200, 100), 2) == 0.0  # all of it ours
    assert th.others_cores(a, th.CpuTimes(150, 200, 50), 2) == 1.0
    assert th.others_cores(a, th.CpuTimes(100, 200, 150), 2) == 0.0  # (clamped: own counted in another window)
    assert th.others_cores(a, th.CpuTimes(1, 1, 0), 2) is None  # under one tick per core: no reading


@pytest.mark.parametrize("others,cores,ncpu,want", [
    (0.0, 2, 2, 2), (0.2, 2, 2, 2), (0.3, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1),
    (0.0, 1, 2, 1),  # affinity: one core allowed
    (3.1, 16, 16, 13), (3.3, 16, 16, 12), (0.0, 16, 16, 16), (15.9, 16, 16, 1),
])
def test_pick_threads(others, cores, ncpu, want):
    assert th.pick_threads(others, cores, ncpu) == want


class Machine:
    """A simulated machine of ``ncpu`` cores: each engine keeps ``threads`` cores busy (capped by the machine),
    ``external`` cores are busy with other work; readings in ticks of 1/100 s."""

    def __init__(self, ncpu: int = 2) -> None:
        self.ncpu, self.t, self.busy, self.external = ncpu, 0.0, 0.0, 0.0
        self.own: dict = {}
        self.engines: dict = {}

    def clock(self) -> float:
        return self.t

    def reader(self, name):
        return lambda: th.CpuTimes(int(self.busy), int(self.t * 100 * self.ncpu), int(self.own.get(name, 0.0)))

    def advance(self, seconds: float) -> None:
        want = {n: p.threads for n, p in self.engines.items()}
        total = sum(want.values()) + self.external
        scale = min(1.0, self.ncpu / total) if total else 1.0
        for n, w in want.items():
            self.own[n] = self.own.get(n, 0.0) + w * scale * seconds * 100
        self.busy += total * scale * seconds * 100
        self.t += seconds


def policy(m: Machine, name: str, **kw) -> th.ThreadPolicy:
    p = th.ThreadPolicy(env={}, cores=m.ncpu, ncpu=m.ncpu, reader=m.reader(name), clock=m.clock, **kw)
    m.engines[name] = p
    return p


def test_alone_takes_every_core_and_a_busy_process_takes_one():
    m = Machine()
    a = policy(m, "a")
    assert a.adaptive and a.source == "auto" and a.threads == 2  # until a reading says otherwise
    m.advance(1.0)
    assert a.check() == 2  # alone
    m.external = 1.0  # a busy loop starts
    m.advance(0.2)
    assert a.tick() is None and a.checks == 1  # not yet due: one clock read, no /proc reading
    m.advance(0.4)
    assert a.tick() == 1  # due: others keep one core busy
    m.advance(0.6)
    assert a.tick() is None and a.threads == 1  # unchanged
    m.external = 0.0
    m.advance(0.6)
    assert a.tick() == 2  # alone again


def test_two_engines_side_by_side_settle_on_a_core_each():
    m = Machine()
    a = policy(m, "a")
    m.advance(1.0)
    assert a.check() == 2
    b = policy(m, "b")  # starts while a computes on both cores
    m.advance(1.0)
    assert b.check() == 1
    for _ in range(6):
        m.advance(0.5)
        a.tick()
        b.tick()
    assert (a.threads, b.threads) == (1, 1)
    del m.engines["b"]  # b stops: a takes both cores back
    m.advance(0.5)
    a.tick()
    assert a.threads == 2


def test_no_proc_keeps_the_cores():
    p = th.ThreadPolicy(env={}, cores=4, ncpu=4, reader=lambda: None, clock=lambda: 10.0)
    assert p.check() == 4 and p.threads == 4


def test_explicit_settings_win():
    m = Machine()
    m.external = 2.0  # a full machine: automatic would pick 1
    p = th.ThreadPolicy(2, env={"OMP_NUM_THREADS": "1"}, cores=2, ncpu=2, reader=m.reader("x"), clock=m.clock)
    assert (p.threads, p.source, p.adaptive) == (2, "argument", False)
    m.advance(5.0)
    assert p.check() == 2 and p.tick() is None and p.checks == 0
    q = th.ThreadPolicy(env={"OMP_NUM_THREADS": "1"}, cores=2, ncpu=2, reader=m.reader("y"), clock=m.clock)
    assert (q.threads, q.source) == (1, "OMP_NUM_THREADS")
    q2 = th.ThreadPolicy(env={"OMP_NUM_THREADS": "3,1"}, cores=2, ncpu=2, reader=m.reader("y"), clock=m.clock)
    assert q2.threads == 3  # the user's count, even above the cores
    r = th.ThreadPolicy(env={"OMP_NUM_THREADS": "lots"}, cores=2, ncpu=2, reader=m.reader("z"), clock=m.clock)
    assert r.source == "auto"  # a value the runtime ignores too


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(InvalidArgumentError, match="threads must be an int >= 1"):
        th.ThreadPolicy(bad, env={})


def test_prepare_runtime():
    env: dict = {}
    assert th.prepare_runtime(env, modules={}) is True and env == {"GOMP_SPINCOUNT": th.SPIN_COUNT}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert th.prepare_runtime(env, modules={}) is True and "GOMP_SPINCOUNT" not in env  # the user's wins
    env = {"GOMP_SPINCOUNT": "7"}
    assert th.prepare_runtime(env, modules={}) is True and env["GOMP_SPINCOUNT"] == "7"
    env = {}
    assert th.prepare_runtime(env, modules={"torch": object()}) is False and env == {}  # too late: torch loaded


# ----------------------------------------------------------------------------------------------- with the engine


def test_llm_threads(engine, monkeypatch):
    torch = pytest.importorskip("torch")
    from pagedkv.engine.llm import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM(engine.paged, num_gpu_blocks=16, run_config=ModelRunConfig(threads=1))
        assert llm.threads == 1 and torch.get_num_threads() == 1 and llm.core._thread_policy.source == "argument"
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
        assert torch.get_num_threads() == 1 and len(out[0].outputs[0].token_ids) > 0
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert LLM(engine.paged, num_gpu_blocks=16).core._thread_policy.source == "OMP_NUM_THREADS"
        monkeypatch.delenv("OMP_NUM_THREADS")
        auto = LLM(engine.paged, num_gpu_blocks=16)
        assert auto.core._thread_policy.adaptive and 1 <= auto.threads == torch.get_num_threads() <= th.usable_cores()
        for bad in (0, "2", True):
            with pytest.raises(InvalidArgumentError, match="threads"):
                LLM(engine.paged, num_gpu_blocks=16, run_config=ModelRunConfig(threads=bad))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cmd", [["generate"], ["chat"], ["bench", "throughput"], ["serve"]])
def test_threads_flag_in_every_engine_command(cmd, capsys):
    from pagedkv.cli import main

    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0 and "--threads N" in capsys.readouterr().out
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--threads", bad, *(["hi"] if cmd == ["generate"] else [])])
        assert e.value.code == 2 and "--threads: must be an integer >= 1" in capsys.readouterr().err


def test_threads_flag_reaches_the_llm():
    import argparse

    from pagedkv.engine.options import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).threads is None and p.parse_args(["--threads", "3"]).threads == 3
    seen = {}

    class Fake:
        def __init__(self, model, **kw):
            seen.update(kw)

    import pagedkv.engine.llm as llm_mod

    real = llm_mod.LLM
    llm_mod.LLM = Fake
    try:
        from pagedkv.engine.options import make_llm

        make_llm(p.parse_args(["--threads", "3"]))
    finally:
        llm_mod.LLM = real
    assert seen["run_config"].threads == 3


def test_one_openmp_runtime(engine):
    """The kernels' libgomp.so.1 is the runtime torch loaded (one thread pool, one wait policy): one library of
    that soname mapped. (Wheels such as sentencepiece's may bring a renamed copy, libgomp-<hash>.so, used by
    their own code only.)"""
    from pagedkv.engine import cpu

    if cpu.kernels() is None:
        pytest.skip("no kernels here")
    import os

    runtimes = th.openmp_runtimes()
    assert len([r for r in runtimes if os.path.basename(r).startswith("libgomp.so")]) == 1, runtimes


def test_initial_count_without_a_window():
    """An engine built on an already loaded model has no window yet: it watches the machine once, briefly."""
    m = Machine()
    m.external = 1.0
    slept = []

    def sleep(s):
        slept.append(s)
        m.advance(s)

    p = th.ThreadPolicy(env={}, cores=2, ncpu=2, reader=m.reader("p"), clock=m.clock, sleep=sleep)
    m.engines["p"] = p
    assert p.initial() == 1 and slept == [th.FIRST_WINDOW_S]
    q = th.ThreadPolicy(env={}, cores=2, ncpu=2, reader=m.reader("q"), clock=m.clock, sleep=sleep)
    m.advance(1.0)  # a model load: a long enough window, no sleep
    assert q.initial() == 1 and len(slept) == 1


@pytest.mark.parametrize("first,want", [("", th.SPIN_COUNT), ("import torch; ", "unset")])
def test_importing_the_engine_sets_the_spin_before_torch(first, want):
    """``import pagedkv.engine`` sets the spin when torch is not loaded yet; after torch it is too late, so it
    does not pretend."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = first + "import os, pagedkv.engine; print(os.environ.get('GOMP_SPINCOUNT', 'unset'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_an_idle_window_is_restarted_not_read():
    """A server idle for a minute while another process ran: the first step does not act on that minute's
    average; the re-check after it reads the recent window."""
    m = Machine()
    a = policy(m, "a")
    m.advance(1.0)
    assert a.check() == 2
    m.external = 2.0  # someone computes while the engine idles...
    m.advance(60.0)
    m.external = 0.0  # ...and stops before the next request
    assert a.tick() is None and a.threads == 2  # stale window dropped, count kept
    m.advance(0.6)
    assert a.tick() is None and a.threads == 2  # the recent window: the machine is free
    m.external = 1.0
    m.advance(0.6)
    assert a.tick() == 1
