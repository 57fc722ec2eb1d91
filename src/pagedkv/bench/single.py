"""Single-sequence calls: pagedkv against a plain-Python reference doing the same bookkeeping, and the anchors.

``python -m pagedkv.bench single [--impl pagedkv reference nanovllm] [--quick]`` (also ``pagedkv bench single``).

The target (issue 8, part 2): every single-sequence call within 3x of a plain-Python function doing the same
bookkeeping and input checks per call. :class:`Reference` is that function set: a minimal block manager whose
state is a dict of per-sequence lists ``[num_tokens, table]``, refcounts in a list indexed by block id and a
FIFO deque of free blocks, without prefix caching, swapping, sliding window or watermark-based admission. Each
call makes the checks pagedkv makes (the sequence looked up in a dict, the tokens' type and range checked one by
one, the lookahead count checked, room checked before anything changes) and the same updates, in the same order,
so the same calls give the same block tables, copy-on-write pairs and free-block order as pagedkv
(``tests/test_single.py`` checks it on random call sequences).

What is measured. Per repeat, on a fresh manager per implementation (caching off, block size 16), ``--seqs`` N
sequences go through, each call timed alone in CPU time of the thread (``time.thread_time_ns``, one clock read
subtracted), the implementations alternating call by call and the garbage collector frozen once the managers are
built (:mod:`pagedkv.bench.fair`):

``allocate``        N prompts of 20 tokens (lists of Python ints);
``append_slots``    ``--rounds`` rounds of one token per sequence (``append_slots(seq, [tok])``), so one call
                    in 16 takes a new block;
``fork``            a child of each sequence (blocks shared, refcounts + 1);
``append_cow``      one token appended to each child: its last block is shared with the parent, so the call
                    returns a copy-on-write pair;
``free``            the N children, then the N parents.

The figure per call is the mean over the N (or rounds x N) calls of a repeat (what a loop over the sequences
costs per sequence, the calls that take a new block included), leaving out the slowest 1% of the calls (on a
shared machine a call now and then waits milliseconds for the CPU, which would swamp a mean of microsecond
calls); the untrimmed mean and the median are in the JSON too. The table gives the median across ``--repeats``
repeats with the min and max, and the ratio to the reference per repeat (median, min, max). The per-call median
is in the JSON too.

Anchors (run under the anchor's virtualenv): the block-manager calls the anchor's scheduler makes for the same
step, called on the anchor directly; the engine-side objects they take (nano-vllm ``Sequence``, vLLM v2
``Sequence`` / ``SequenceGroup`` and a fork's deep copy, vLLM V1 ``Request``) are made, and (except for V1) the
sampled token appended to them, untimed; V1's request update (``Request.append_output_token_ids``, where V1
hashes a block that has filled) is timed with its ``append_slots``. ``allocate``: nano-vllm ``can_allocate`` + ``allocate``, vLLM v2 ``can_allocate`` +
``allocate``, vLLM V1 ``get_computed_blocks`` + ``allocate_slots``; ``append_slots``: the dict lookup of the
anchor's sequence object, then nano-vllm ``may_append``, vLLM v2 ``append_slots(seq, 0)``, vLLM V1 the request
update and ``allocate_slots(request, 1)``; ``fork``: vLLM v2 ``fork(parent, child)``; ``free``: nano-vllm ``deallocate``,
vLLM v2 ``free``, vLLM V1 ``free``. nano-vllm and vLLM V1 have no fork (no ``fork`` or ``append_cow`` rows).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokensError,
    OutOfBlocksError,
    PromptTooLongError,
    UnknownSequenceError,
)
from .._help import HelpFormatter, plain
from .meta import machine as _machine, versions as _versions
from .fair import CLOCK, alternate, clock_overhead, engine_gc
from .report import save_result

__all__ = ["CALLS", "Reference", "run_single", "format_table", "main"]

CALLS = ("allocate", "append_slots", "fork", "append_cow", "free")
PROMPT_LEN = 20
BLOCK_SIZE = 16
TARGET = 3.0
_TOKEN_MAX = 2**31 - 1


class Reference:
    """Plain-Python block manager: pagedkv's single-sequence calls (caching off) as straightforward Python.

    ``allocate``, ``append_slots``, ``fork``, ``free`` and ``block_table`` have pagedkv's signatures, results and
    exceptions for what they support (no prefix caching, swap, sliding window; ``namespace`` must be None).
    """

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, *, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.seqs: dict[Hashable, list] = {}  # seq_id -> [num_tokens, block table (list of ids)]
        self.ref = [0] * num_gpu_blocks
        self.free_blocks = deque(range(num_gpu_blocks))  # oldest free first

    @property
    def num_free_gpu_blocks(self) -> int:
        return len(self.free_blocks)

    # -- checks ----------------------------------------------------------------------------------------
    def _seq(self, seq_id: Hashable) -> list:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None
        except TypeError:
            raise InvalidArgumentError(f"seq_id must be hashable, got {type(seq_id).__name__}") from None

    def _new_id(self, seq_id: Hashable) -> None:
        try:
            exists = seq_id in self.seqs
        except TypeError:
            raise InvalidArgumentError(f"seq_id must be hashable, got {type(seq_id).__name__}") from None
        if exists:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")

    @staticmethod
    def _tokens(token_ids: Any) -> int:
        """Check a 1-D sequence of token ids (ints in [0, 2**31)); returns how many."""
        if not isinstance(token_ids, (list, tuple)):
            token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        if not token_ids:
            raise InvalidTokensError("token_ids is empty")
        for t in token_ids:
            if type(t) is not int and (isinstance(t, bool) or not isinstance(t, (int, np.integer))):
                raise InvalidTokensError(f"token_ids must be integers, got {type(t).__name__}")
            if not 0 <= t <= _TOKEN_MAX:
                raise InvalidTokensError("token_ids must lie in [0, 2**31)")
        return len(token_ids)

    def _take(self) -> int:
        b = self.free_blocks.popleft()
        self.ref[b] = 1
        return b

    # -- calls -----------------------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, namespace: object = None) -> int:
        self._new_id(seq_id)
        n = self._tokens(token_ids)
        if namespace is not None:
            raise NotImplementedError("the reference has no prefix cache")
        nblocks = -(-n // self.block_size)
        if nblocks > self.num_gpu_blocks - self.watermark_blocks:
            raise PromptTooLongError(f"prompt of {n} tokens needs {nblocks} blocks")
        if nblocks > len(self.free_blocks):
            raise OutOfBlocksError(f"prompt of {n} tokens needs {nblocks} new blocks")
        take = self._take
        self.seqs[seq_id] = [n, [take() for _ in range(nblocks)]]
        return 0

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        s = self._seq(seq_id)
        k = self._tokens(token_ids)
        la = num_lookahead_slots
        if type(la) is not int or la < 0:
            raise InvalidArgumentError(f"num_lookahead_slots must be an int >= 0, got {la!r}")
        n, table = s
        bs, ref = self.block_size, self.ref
        end = n + k
        nb = len(table)
        need = max(-(-(end + la) // bs), nb)
        # blocks written, or holding reserved lookahead slots (draft KV), still shared: copied on write
        shared = [j for j in range(n // bs, min((end + la - 1) // bs, nb - 1) + 1) if ref[table[j]] > 1]
        if need - nb + len(shared) > len(self.free_blocks):
            raise OutOfBlocksError(f"the append needs {need - nb + len(shared)} new blocks")
        cow = []
        for j in shared:  # copy-on-write destinations first, then new blocks (pagedkv's order)
            src = table[j]
            dst = self._take()
            ref[src] -= 1
            table[j] = dst
            cow.append((src, dst))
        for _ in range(need - nb):
            table.append(self._take())
        s[0] = end
        return cow

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        n, table = self._seq(parent_seq_id)
        self._new_id(child_seq_id)
        ref = self.ref
        for b in table:
            ref[b] += 1
        self.seqs[child_seq_id] = [n, table.copy()]

    def free(self, seq_id: Hashable, *, cache: bool = True) -> None:
        _, table = self._seq(seq_id)
        del self.seqs[seq_id]
        ref, free = self.ref, self.free_blocks
        for b in reversed(table):  # tail first, as pagedkv
            ref[b] -= 1
            if ref[b] == 0:
                free.append(b)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id)[1])

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._seq(seq_id)[0]


# ---------------------------------------------------------------------------------------------- drivers
class _Driver:
    """The timed calls for one implementation; each method does one call and returns its ns."""

    def __init__(self, name: str, num_blocks: int) -> None:
        self.name = name
        self.clock = CLOCK
        if name == "reference":
            self.mgr = Reference(num_blocks, BLOCK_SIZE)
        else:
            from .harness import resolve_impl

            impl = resolve_impl(name)
            if impl.unavailable:
                raise LookupError(impl.unavailable)
            self.mgr = impl.factory(num_blocks, BLOCK_SIZE)
        self.has_fork = name in ("reference", "pagedkv") or "fork" in getattr(self.mgr, "supports", ())

    def allocate(self, sid: int, prompt: list) -> int:
        t0 = self.clock()
        self.mgr.allocate(sid, prompt)
        return self.clock() - t0

    def append(self, sid: int, tok: list) -> int:
        t0 = self.clock()
        self.mgr.append_slots(sid, tok)
        return self.clock() - t0

    def fork(self, parent: int, child: int) -> int:
        t0 = self.clock()
        self.mgr.fork(parent, child)
        return self.clock() - t0

    def free(self, sid: int) -> int:
        t0 = self.clock()
        self.mgr.free(sid)
        return self.clock() - t0


class _NanoVllm(_Driver):
    """nano-vllm: admission ``can_allocate`` + ``allocate``, ``may_append``, ``deallocate`` (its scheduler's calls)."""

    def allocate(self, sid: int, prompt: list) -> int:
        a = self.mgr
        seq = a._Seq(list(prompt))
        t0 = self.clock()
        if not a.bm.can_allocate(seq):
            raise OutOfBlocksError("nano-vllm: no room")
        a.bm.allocate(seq)
        t = self.clock() - t0
        seq.status = sys.modules[type(a).__module__].SequenceStatus.RUNNING
        a._seqs[sid] = seq
        return t

    def append(self, sid: int, tok: list) -> int:
        a = self.mgr
        a.prepare_step([sid], [tok])  # untimed: Sequence.append_token
        t0 = self.clock()
        a.bm.may_append(a._seqs[sid])
        return self.clock() - t0

    def free(self, sid: int) -> int:
        a = self.mgr
        seq = a._seqs.pop(sid)
        seq.status = sys.modules[type(a).__module__].SequenceStatus.FINISHED
        t0 = self.clock()
        a.bm.deallocate(seq)
        return self.clock() - t0


class _VllmV2(_Driver):
    """vLLM v2: ``can_allocate`` + ``allocate(group)``, ``append_slots(seq, 0)``, ``fork(parent, child)``,
    ``free(seq)``; the Sequence / SequenceGroup objects (and a fork's deep copy) are made untimed."""

    def allocate(self, sid: int, prompt: list) -> int:
        a = self.mgr
        seq, group = a._new_group(sid, prompt)
        t0 = self.clock()
        a.bm.can_allocate(group)
        a.bm.allocate(group)
        t = self.clock() - t0
        seq.status = sys.modules[type(a).__module__].SequenceStatus.RUNNING
        a._seqs[sid], a._group[sid] = seq, group
        return t

    def append(self, sid: int, tok: list) -> int:
        a = self.mgr
        a.prepare_step([sid], [tok])  # untimed: SequenceData bookkeeping, Sequence.append_token_id
        t0 = self.clock()
        a.bm.append_slots(a._seqs[sid], 0)
        return self.clock() - t0

    def fork(self, parent: int, child: int) -> int:
        a = self.mgr
        p, group = a._seqs[parent], a._group[parent]
        c = p.fork(child)
        group.add(c)
        t0 = self.clock()
        a.bm.fork(p, c)
        t = self.clock() - t0
        a._seqs[child], a._group[child] = c, group
        return t

    def free(self, sid: int) -> int:
        a = self.mgr
        seq, group = a._seqs.pop(sid), a._group.pop(sid)
        seq.status = sys.modules[type(a).__module__].SequenceStatus.FINISHED_STOPPED
        t0 = self.clock()
        a.bm.free(seq)
        t = self.clock() - t0
        if len(group.seqs) > 1:
            group.remove(sid)
        return t


class _VllmV1(_Driver):
    """vLLM V1: ``get_computed_blocks`` + ``allocate_slots`` (admission), ``allocate_slots(request, 1)``,
    ``free(request)``; the Request objects are made untimed."""

    def allocate(self, sid: int, prompt: list) -> int:
        a = self.mgr
        req = a._request(sid, prompt)
        km = a.km
        t0 = self.clock()
        blocks, hit, _ = km.get_computed_blocks(req)
        new = km.allocate_slots(req, req.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                full_sequence_must_fit=True, has_scheduled_reqs=bool(a._reqs))
        t = self.clock() - t0
        if new is None:
            raise OutOfBlocksError("vLLM V1: no room")
        req.status = sys.modules[type(a).__module__].RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens
        a._reqs[sid] = req
        return t

    def append(self, sid: int, tok: list) -> int:
        a = self.mgr
        a.stage([sid], [tok])  # untimed: the adapter's own bookkeeping
        t0 = self.clock()
        a.update_requests()  # V1's engine: num_computed_tokens, Request.append_output_token_ids (its hashing)
        a.km.allocate_slots(a._reqs[sid], 1)
        return self.clock() - t0

    def free(self, sid: int) -> int:
        a = self.mgr
        req = a._reqs.pop(sid)
        req.status = sys.modules[type(a).__module__].RequestStatus.FINISHED_STOPPED
        t0 = self.clock()
        a.km.free(req)
        return self.clock() - t0


_DRIVERS = {"nanovllm": _NanoVllm, "vllm_v2": _VllmV2, "vllm_v1": _VllmV1}


def _one_repeat(names: Sequence[str], n: int, rounds: int, seed: int) -> dict[str, dict]:
    """One repeat of every implementation in ``names``, alternating call by call (call i of every implementation
    before call i + 1 of any, the first rotating; :func:`pagedkv.bench.fair.alternate`), the garbage collector
    frozen once the managers are built. Returns per implementation its figures per call (one clock read
    subtracted from each call). LookupError if an implementation cannot run here."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, 32_000, size=(n, PROMPT_LEN)).tolist()
    toks = [[[t] for t in row] for row in rng.integers(0, 32_000, size=(rounds + 1, n)).tolist()]
    num_blocks = 2 * n * (-(-(PROMPT_LEN + rounds + 1) // BLOCK_SIZE) + 1) + 16
    drivers = {name: _DRIVERS.get(name, _Driver)(name, num_blocks) for name in names}
    ns: dict[str, dict[str, list[int]]] = {name: {c: [] for c in CALLS} for name in names}

    def phase(call: str, which: dict, fn: Callable[[Any, int], int]) -> None:
        order = list(which.items())
        runs = alternate([lambda i, d=d: {"x": fn(d, i)} for _, d in order], n)
        for (name, _), got in zip(order, runs):
            ns[name][call].extend(g["x"] for g in got)

    with engine_gc():
        phase("allocate", drivers, lambda d, i: d.allocate(i, prompts[i]))
        for r in range(rounds):
            row = toks[r]
            phase("append_slots", drivers, lambda d, i: d.append(i, row[i]))
        forking = {name: d for name, d in drivers.items() if d.has_fork}
        if forking:
            phase("fork", forking, lambda d, i: d.fork(i, n + i))
            row = toks[rounds]
            phase("append_cow", forking, lambda d, i: d.append(n + i, row[i]))
            phase("free", forking, lambda d, i: d.free(n + i))
        phase("free", drivers, lambda d, i: d.free(i))
    overhead = clock_overhead()
    result: dict[str, dict] = {}
    for name in names:
        out = {}
        for c, v in ns[name].items():
            if v:
                a = np.maximum(np.asarray(v, dtype=np.int64) - overhead, 0)
                kept = a[a <= np.percentile(a, 99)]  # drop the 1% slowest: the OS preempting the process
                out[c] = {"mean_us": float(kept.mean()) / 1e3, "raw_mean_us": float(a.mean()) / 1e3,
                          "median_us": float(np.median(a)) / 1e3, "calls": len(v)}
        result[name] = out
    return result


def _mmm(vals: Sequence[float]) -> dict:
    a = np.asarray(vals, dtype=float)
    return {"min": float(a.min()), "median": float(np.median(a)), "max": float(a.max())}


def run_single(impl_names: Sequence[str], *, seqs: int = 1000, rounds: int = 16, repeats: int = 5, seed: int = 0,
               progress: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark (the reference is always included); returns the result document's body."""
    names = ["reference", *[n for n in impl_names if n != "reference"]]
    skipped: dict[str, str] = {}
    for name in names:  # find out what cannot run here
        try:
            _one_repeat([name], 8, 1, seed)
        except LookupError as exc:
            skipped[name] = str(exc)
    names = [n for n in names if n not in skipped]
    _one_repeat(names, min(seqs, 64), 2, seed)  # warm-up
    say = progress or (lambda s: None)
    reps: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repeats):
        say(f"repeat {rep + 1}/{repeats}")
        for name, got in _one_repeat(names, seqs, rounds, seed + rep).items():
            reps[name].append(got)
    results = []
    for name, rs in reps.items():
        for call in CALLS:
            if call not in rs[0]:
                continue
            rec = {"impl": name, "call": call, "calls_per_repeat": rs[0][call]["calls"],
                   "us_per_call": _mmm([r[call]["mean_us"] for r in rs]),
                   "median_us_per_call": _mmm([r[call]["median_us"] for r in rs])}
            if name != "reference":
                rec["ratio_to_reference"] = _mmm([r[call]["mean_us"] / b[call]["mean_us"]
                                                  for r, b in zip(rs, reps["reference"])])
            results.append(rec)
    return {"config": {"impl": list(impl_names), "seqs": seqs, "rounds": rounds, "repeats": repeats, "seed": seed,
                       "block_size": BLOCK_SIZE, "prompt_len": PROMPT_LEN, "target_ratio": TARGET},
            "skipped": skipped, "results": results}


def format_table(docs: Sequence[dict]) -> str:
    """Markdown: us per call (median [min-max] across repeats) and the ratio to the reference, per call and
    implementation; the reference of each file is the one measured with it."""
    rows = []
    for d in docs:
        for r in d["results"]:
            rows.append(r)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    out = ["| call | impl | us per call | x reference | pagedkv within 3x |", "|---|---|---|---|---|"]
    for call in CALLS:
        for name in impls:
            for r in (r for r in rows if r["call"] == call and r["impl"] == name):
                u = r["us_per_call"]
                cell = f"{u['median']:.2f} [{u['min']:.2f}-{u['max']:.2f}]"
                if "ratio_to_reference" in r:
                    q = r["ratio_to_reference"]
                    ratio = f"{q['median']:.1f}x [{q['min']:.1f}-{q['max']:.1f}]"
                    ok = ("yes" if q["median"] <= TARGET else "no") if name == "pagedkv" else ""
                else:
                    ratio, ok = "1", ""
                out.append(f"| {call} | {name} | {cell} | {ratio} | {ok} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        docs = [json.loads(Path(f).read_text()) for f in argv[1:]]
        print(format_table(docs), end="")
        return 0
    ap = argparse.ArgumentParser(prog="pagedkv bench single", description=plain(__doc__), formatter_class=HelpFormatter)
    ap.add_argument("--impl", nargs="+", default=["pagedkv"], metavar="NAME",
                    help="pagedkv and anchors (the plain-Python reference always runs)")
    ap.add_argument("--seqs", type=int, default=None, help="sequences per repeat (default 1000, quick 50)")
    ap.add_argument("--rounds", type=int, default=None, help="one-token appends per sequence (default 16, quick 4)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, quick 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    ap.add_argument("--quick", action="store_true", help="a smoke run of a fraction of a second")
    ap.add_argument("--out", default="benchmarks/results", metavar="DIR", help="where the JSON goes")
    ap.add_argument("--no-save", action="store_true", help="do not write the JSON file")
    a = ap.parse_args(argv)
    seqs = a.seqs or (50 if a.quick else 1000)
    rounds = a.rounds or (4 if a.quick else 16)
    repeats = a.repeats or (1 if a.quick else 5)
    t0 = time.perf_counter()
    body = run_single(a.impl, seqs=seqs, rounds=rounds, repeats=repeats, seed=a.seed,
                      progress=lambda s: print(s, file=sys.stderr, flush=True))
    for name, why in body["skipped"].items():
        print(f"skipped {name}: {why}", file=sys.stderr)
    doc = {"schema": 1, "kind": "single",
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": shlex.join([Path(sys.executable).name, "-m", "pagedkv.bench", "single", *argv]),
           "argv": list(sys.argv), "machine": _machine(), "versions": _versions(),
           "elapsed_s": round(time.perf_counter() - t0, 1), **body}
    print(format_table([doc]), end="")
    if not a.no_save:
        print(f"\nwrote {save_result(doc, a.out, 'single', a.impl, a.quick)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
