"""The engine's CPU runtime, torch-free: the C kernels' build and the OpenMP threads they and torch run on.

**The kernels** (``_qkernels.c``, AVX-512 / AVX2 / plain C by what the CPU has): the products with the file's
quantized weights for the few-row steps (:class:`pagedkv.engine.model.QuantLinear`) and the ragged paged attention
(:mod:`pagedkv.engine.paged_attention`). They are compiled once per machine with the system's C compiler (``cc -O3
-march=native -ffp-contract=off -fopenmp``) into ``~/.cache/pagedkv/kernels`` (``PAGEDKV_KERNEL_CACHE`` overrides;
a home that cannot be written: a private folder in the temporary directory; the file is keyed by the source, the
compiler, its flags and the CPU) and loaded with ctypes. No compiler, a failed build or ``PAGEDKV_QKERNELS=0``:
:func:`kernels` returns ``None`` and every product is the dense float32 one.

**The threads.** Torch and the kernels run their parallel loops on one OpenMP thread pool
(``torch.get_num_threads()`` threads; the kernels' ``libgomp.so.1`` resolves to the runtime torch already loaded,
see :func:`openmp_runtimes`), and OpenMP threads spin at every barrier. Alone on a machine that wins, but as
soon as another process wants a core, one of the threads is descheduled and the others spin waiting for it: on
the 2-core development machine SmolLM2 at batch 1 fell from 52.3 output tok/s to 10.1 beside one busy process,
and two engines side by side made 7.6 + 7.8 tok/s where one thread each gives 116 + 128 (docs/engine-speed.md).
What :class:`ThreadPolicy` does with no explicit setting:

* **Thread count from the cores that are free**: the CPU time the machine spent busy, minus this process's own,
  over a window (``/proc/stat`` and ``/proc/self/stat``), says how many cores others use (niced processes not
  counted where the scheduler makes them yield to this one: :func:`nice_yields`); the engine takes the
  rest (:func:`pick_threads`: at least 1, at most the cores this process may run on, a core counted free only
  when less than :data:`FREE_MARGIN` of it is used by others). Re-checked every :data:`RECHECK_S` seconds of
  engine steps (one read of two small /proc files: 53 us of CPU time, measured on the 2-core machine; a
  step not due for a re-check costs one clock read, 0.1 us), so replicas
  started side by side settle on a core each, and an engine left alone again takes both.
* **Spin as libgomp does, not longer**: unless the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``,
  :func:`prepare_runtime` sets ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` (libgomp's own default, 300000) before torch
  loads the OpenMP runtime, so a library that asked for active waiting cannot make threads spin without end. The
  thread count, not the wait policy, is what keeps the engine sound beside other processes: with it, a thread whose
  partner was descheduled spins at most until the next re-check drops the count. Measured on the quiet 2-core
  machine (benchmarks/threads_robust.py, SmolLM2): passive waits (``GOMP_SPINCOUNT=0``) at 2 threads alone made
  31.4 / 142.6 / 190.2 tok/s at batch 1 / 8 / 32 against 49.5 / 151.2 / 128.1 at one thread; the default spin
  62.8 / 247.0 / 242.4.
  It is called when ``pagedkv.engine`` is imported; if torch was imported first, the runtime already read its
  settings and only the thread count adapts (:func:`prepare_runtime` returns ``False``).
* **An explicit setting always wins**: ``ModelRunConfig(threads=N)`` / ``--threads N``, else ``OMP_NUM_THREADS``
  from the environment: that count, fixed, never re-checked.

The caller applies the count (``torch.set_num_threads``); this module does not import torch. The /proc readings
are injected (``reader``, ``clock``) so the logic is tested deterministically.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any, Callable, NamedTuple

from ..errors import InvalidArgumentError

__all__ = ["ENTRY_POINTS", "FIRST_WINDOW_S", "FREE_MARGIN", "RECHECK_S", "SPIN_COUNT", "STALE_S", "CpuTimes",
           "FUSED_STEP", "ThreadPolicy", "layer_table", "step_kernel",
           "build_kernels", "kernel_status", "kernels", "nice_yields", "openmp_runtimes", "others_cores",
           "parse_proc_stat", "parse_self_stat", "pick_threads", "prepare_runtime", "read_cpu_times",
           "usable_cores", "validate_threads"]

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
_NATIVE = ("-march=native",)
#: the kernel entry point of each blocks layout (:attr:`pagedkv.engine.quant_blocks.QuantBlocks.kind`)
ENTRY_POINTS = {"Q4_1": "pkv_q4_1_mm", "Q5_0": "pkv_q5_0_mm", "Q8_0": "pkv_q8_0_mm", "Q8_16": "pkv_q8_16_mm"}


# --------------------------------------------------------------------------------------------------- the build

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _cache_dir() -> Path:
    """Where compiled kernels live: ``PAGEDKV_KERNEL_CACHE`` when set, else ``~/.cache/pagedkv/kernels``, else (a
    home that cannot be written) a private folder of this user in the temporary directory. ``OSError`` when none
    can be used."""
    env = os.environ.get("PAGEDKV_KERNEL_CACHE")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return Path(env)
    try:
        home = Path.home() / ".cache" / "pagedkv" / "kernels"
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except (OSError, RuntimeError):  # (RuntimeError: no home directory)
        pass
    uid = os.getuid() if hasattr(os, "getuid") else 0
    tmp = Path(tempfile.gettempdir()) / f"pagedkv-kernels-{uid}"
    tmp.mkdir(mode=0o700, exist_ok=True)
    st = tmp.stat()
    if getattr(st, "st_uid", uid) != uid or st.st_mode & 0o022:  # another user's, or writable by others
        raise OSError(f"{tmp} is not a private folder of this user")
    return tmp


def build_kernels(arch: tuple[str, ...] = _NATIVE) -> ctypes.CDLL:
    """Compile (once; cached by source, compiler, flags and CPU) and load the kernels for the target ``arch``
    (compiler flags; default ``-march=native``; ``("-mavx2", "-mfma")`` or ``()`` for the AVX2 and plain-C
    variants, which the tests check too). ``RuntimeError`` when there is no compiler or it fails."""
    src = resources.files("pagedkv.engine").joinpath("_qkernels.c").read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = [*_FLAGS, *arch]
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode() + _cpu_tag().encode()).hexdigest()[:16]
    cache = _cache_dir()
    lib = cache / f"qkernels-{key}.so"
    if not lib.is_file():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            c_file = Path(tmp) / "_qkernels.c"
            c_file.write_bytes(src)
            out = Path(tmp) / lib.name
            r = subprocess.run([cc, *flags, str(c_file), "-o", str(out)], capture_output=True, text=True,
                               timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
            os.replace(out, lib)  # atomic: concurrent builders each install a complete file
    dll = ctypes.CDLL(str(lib))
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ENTRY_POINTS.values():  # one signature: (x, B, ldx, K, qs, d, aux, n0, n1, y, ldy, threads)
        fn = getattr(dll, name)
        fn.argtypes = [vp, i64, i64, i64, vp, vp, vp, i64, i64, vp, i64, ci]
        fn.restype = None
    dll.pkv_isa.restype = ctypes.c_char_p
    return dll


def kernels() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use (a second or two); ``None`` when disabled
    (``PAGEDKV_QKERNELS=0``) or the build failed (:func:`kernel_status` says why; logged once)."""
    if "dll" not in _state:
        with _lock:
            if "dll" not in _state:
                if os.environ.get("PAGEDKV_QKERNELS", "1") == "0":
                    _state["dll"], _state["why"] = None, "disabled by PAGEDKV_QKERNELS=0"
                else:
                    try:
                        dll = build_kernels()
                        _state["dll"], _state["why"] = dll, f"built ({dll.pkv_isa().decode()})"
                    except Exception as e:  # noqa: BLE001 - any failure falls back to the dense products
                        _state["dll"], _state["why"] = None, f"unavailable: {e}"
                        log.warning("pagedkv: quantized kernels %s; using float32 products", _state["why"])
    return _state["dll"]


def kernel_status() -> str:
    """Whether the kernels are in use, and why not: ``"built (avx512)"``, ``"disabled by ..."``, ``"unavailable:
    ..."``."""
    kernels()
    return _state["why"]


# --------------------------------------------------------------------------------------------------- the fused step
# ``pkv_llama_step`` / ``pkv_gemma3_step`` (``_qkernels.c``): every layer of a few-row decode step in one call (used
# by ``PagedLlama.hidden`` / ``PagedGemma3.hidden`` when :data:`FUSED_STEP` and the step qualifies). The layer table
# is built once per model from raw pointers (:func:`layer_table`); the tensors behind them stay owned by the model.

#: whether few-row steps run as one C call (``PAGEDKV_FUSED_STEP=0`` turns it off, for A/B runs)
FUSED_STEP = os.environ.get("PAGEDKV_FUSED_STEP", "1") != "0"
_KIND_CODE = {"Q4_1": 0, "Q5_0": 1, "Q8_0": 2, "Q8_16": 3}
_MAX_PARTS = 4


class _Part(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("aux", ctypes.c_void_p),
                ("row", ctypes.c_int64), ("n", ctypes.c_int64)]


class _Lin(ctypes.Structure):
    _fields_ = [("parts", _Part * _MAX_PARTS), ("nparts", ctypes.c_int64)]


_LINS = [("qkv", _Lin), ("o", _Lin), ("gu", _Lin), ("down", _Lin)]
_vp = ctypes.c_void_p


class _Layer(ctypes.Structure):  # pkv_layer
    _fields_ = [("attn_norm", _vp), ("ffn_norm", _vp), *_LINS]


class _GLayer(ctypes.Structure):  # pkv_glayer
    _fields_ = [("attn_norm", _vp), ("qk_norm", _vp), ("post_attn_norm", _vp), ("ffn_norm", _vp),
                ("post_ffw_norm", _vp), *_LINS]


def layer_table(layers: list[tuple], gemma3: bool = False) -> Any:
    """The C table of a model's layers (``pkv_layer``, or ``pkv_glayer`` with ``gemma3``), or ``None`` when a product
    has more than 4 parts. ``layers[i]``: the norms' pointers (Llama: attention, MLP; Gemma 3: attention, query and
    key, after the attention, MLP, after the MLP), then the products ``qkv, o, gate_up, down``, each a list of parts
    ``(kind, qs, d, aux, first output row, rows)`` (``kind`` a :attr:`~pagedkv.engine.quant_blocks.QuantBlocks.kind`,
    the others pointers or ints, ``aux`` possibly ``None``). O(layers)."""
    cls = _GLayer if gemma3 else _Layer
    n_norms = len(cls._fields_) - len(_LINS)
    table = (cls * len(layers))()
    for entry, layer in zip(table, layers):
        for (name, _), ptr in zip(cls._fields_, layer[:n_norms]):
            setattr(entry, name, ptr)
        for (name, _), parts in zip(_LINS, layer[n_norms:]):
            if len(parts) > _MAX_PARTS:
                return None
            lin = getattr(entry, name)
            lin.nparts = len(parts)
            for slot, (kind, qs, d, aux, row, n) in zip(lin.parts, parts):
                slot.kind, slot.qs, slot.d, slot.aux, slot.row, slot.n = _KIND_CODE[kind], qs, d, aux, row, n
    return table


def step_kernel(name: str) -> Any:
    """``pkv_llama_step`` or ``pkv_gemma3_step`` with its signature set, or ``None`` without kernels (or with
    :data:`FUSED_STEP` off)."""
    if name not in _state:
        dll = kernels() if FUSED_STEP else None
        fn = None if dll is None else getattr(dll, name)
        if fn is not None:
            i64, vp, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
            if name == "pkv_llama_step":
                fn.argtypes = [vp, i64, i64, i64, i64, i64, i64, i64, f32, f32, *[vp] * 12, i64, i64, vp, i64, vp,
                               i64, i64, vp, vp, ctypes.c_int]
            else:
                fn.argtypes = [vp, vp, i64, i64, i64, i64, i64, i64, i64, f32, f32, *[vp] * 8, i64, i64, vp, vp,
                               ctypes.c_int]
            fn.restype = i64
        _state[name] = fn
    return _state[name]

# --------------------------------------------------------------------------------------------------- the threads

#: (docs/engine-speed.md): alone, 2 threads with passive waits (0) lost to one thread (31.4 against 49.5 tok/s at
#: batch 1), with the default spin they win (62.8); beside a busy process or a second engine the thread count drops
#: to one core within a re-check, where the spin no longer matters (1.05-1.15x the one-thread figure)
SPIN_COUNT = "300000"
#: a core counts as free when others keep less than this fraction of it busy (:func:`pick_threads`)
FREE_MARGIN = 0.25
#: seconds between two re-checks of the free cores while the engine steps
RECHECK_S = 0.5
#: a window longer than this (the engine was idle, no steps) is dropped and restarted rather than read
STALE_S = 5.0
#: seconds an engine built on an already loaded model watches the machine before its first count (once per
#: process: later engines start from the count last chosen)
FIRST_WINDOW_S = 0.05

_recent: dict = {}  # the count the last real (not injected) reading chose, for engines that start with no window


class CpuTimes(NamedTuple):
    """One reading, in clock ticks: ``busy`` and ``total`` CPU time of the whole machine (all cores) since boot,
    ``own`` the CPU time of this process (all its threads)."""

    busy: int
    total: int
    own: int


def parse_proc_stat(text: str, yield_nice: bool = False) -> tuple[int, int]:
    """``(busy, total)`` ticks from the first line of ``/proc/stat`` (``cpu user nice system idle iowait irq
    softirq steal ...``): busy is everything but idle and iowait, and with ``yield_nice`` also but the ``nice``
    column (the time of processes at a positive nice value, which yield a core to this engine: see
    :func:`nice_yields`). ``ValueError`` on another format."""
    line = text.split("\n", 1)[0].split()
    if not line or line[0] != "cpu" or len(line) < 5:
        raise ValueError(f"not a /proc/stat cpu line: {text[:60]!r}")
    v = [int(x) for x in line[1:9]]
    total = sum(v)
    return total - v[3] - (v[4] if len(v) > 4 else 0) - (v[1] if yield_nice else 0), total


def nice_yields(autogroup_path: str = "/proc/sys/kernel/sched_autogroup_enabled",
                own_nice: int | None = None) -> bool:
    """Whether the CPU time of niced processes is time this engine can have: True when this process runs at nice
    <= 0 and the scheduler compares nice values across the whole machine (no autogroup). Then a process at nice
    10 or 19 beside the engine gets a slice only when the engine's threads leave one (CFS weights: 1024 at nice 0
    against 110 at 10 and 15 at 19), so a core it keeps busy is still free for the engine. With autogroup on (the
    default of many desktop kernels: ``/proc/sys/kernel/sched_autogroup_enabled`` is 1) each session shares the
    CPU as a whole whatever its nice value, so a niced process in another session counts as busy. A kernel
    without the file has no autogroup."""
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0) if own_nice is None else own_nice
    except (AttributeError, OSError):
        return False
    if own > 0:  # this process's own time is then in the nice column too
        return False
    try:
        with open(autogroup_path) as f:
            return f.read().strip() == "0"
    except OSError:
        return True


def parse_self_stat(text: str) -> int:
    """This process's ``utime + stime`` ticks from ``/proc/self/stat`` (fields 14 and 15; the command name, field
    2, may hold spaces and parentheses, so fields are counted after its last ``)``)."""
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def read_cpu_times() -> CpuTimes | None:
    """The current :class:`CpuTimes`, or ``None`` where /proc cannot be read (not Linux). About 53 us of CPU.
    Niced processes' time counts as busy unless :func:`nice_yields` (read once per process)."""
    if "nice_yields" not in _recent:
        _recent["nice_yields"] = nice_yields()
    try:
        with open("/proc/stat") as f:
            busy, total = parse_proc_stat(f.readline(), _recent["nice_yields"])
        with open("/proc/self/stat") as f:
            own = parse_self_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None
    return CpuTimes(busy, total, own)


def others_cores(prev: CpuTimes, cur: CpuTimes, ncpu: int) -> float | None:
    """How many of the machine's ``ncpu`` cores other processes kept busy between two readings (0 .. ncpu), or
    ``None`` when too little time passed to say (fewer than one tick per core)."""
    d_total = cur.total - prev.total
    if d_total < ncpu:
        return None
    others = (cur.busy - prev.busy) - (cur.own - prev.own)
    return min(float(ncpu), max(0.0, others * ncpu / d_total))


def pick_threads(others: float, cores: int, ncpu: int) -> int:
    """Threads for an engine that may run on ``cores`` of the machine's ``ncpu`` cores while others keep
    ``others`` cores busy: the free cores, a core counted free when others use less than :data:`FREE_MARGIN` of
    it; at least 1, at most ``cores``."""
    free = ncpu - others
    return max(1, min(cores, int(free + FREE_MARGIN)))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def validate_threads(threads: object) -> int | None:
    """``threads`` as given to ``ModelRunConfig(threads=)``: ``None`` (automatic) or an int >= 1;
    ``InvalidArgumentError`` otherwise."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads must be an int >= 1 or None (automatic), got {threads!r}")
    return threads


def _env_threads(env: dict) -> int | None:
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    try:
        n = int(raw.split(",")[0])  # OpenMP allows a list per nesting level; the first is ours
    except ValueError:
        return None  # an unparseable value: the runtime ignores it too
    return n if n >= 1 else None


def prepare_runtime(env: dict | None = None, modules: dict | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` in ``env`` (default ``os.environ``) when the user set neither it
    nor ``OMP_WAIT_POLICY`` and torch is not loaded yet (``modules``: default ``sys.modules``). Returns whether
    the setting will take effect (``True`` also when the user's own wait policy is in place). O(1)."""
    env = os.environ if env is None else env
    modules = sys.modules if modules is None else modules
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return True
    if "torch" in modules:
        return False
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


class ThreadPolicy:
    """The engine's thread count: fixed when given (``threads``, else ``OMP_NUM_THREADS`` in ``env``), else
    chosen from the free cores and re-checked every ``recheck_s`` seconds by :meth:`tick`.

    ``reader`` returns :class:`CpuTimes` (or ``None``: no /proc, then the policy keeps ``cores`` threads, as torch
    would), ``clock`` seconds; both injectable for tests. ``InvalidArgumentError`` for a bad ``threads``."""

    def __init__(self, threads: int | None = None, *, env: dict | None = None, cores: int | None = None,
                 ncpu: int | None = None, reader: Callable[[], CpuTimes | None] = read_cpu_times,
                 clock: Callable[[], float] = time.monotonic, recheck_s: float = RECHECK_S,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        threads = validate_threads(threads)
        env = os.environ if env is None else env
        self._cores = usable_cores() if cores is None else cores
        self._ncpu = (os.cpu_count() or self._cores) if ncpu is None else ncpu
        self._reader, self._clock, self._recheck_s, self._sleep = reader, clock, recheck_s, sleep
        env_n = _env_threads(env)
        if threads is not None:
            self._fixed, self._source = threads, "argument"
        elif env_n is not None:
            self._fixed, self._source = env_n, "OMP_NUM_THREADS"
        else:
            self._fixed, self._source = None, "auto"
        self._threads = self._fixed if self._fixed is not None else self._cores
        self._last = reader() if self._fixed is None else None
        self._last_t = clock()
        self.checks = 0  # re-checks done (for tests and the benchmark's record)

    @property
    def threads(self) -> int:
        """The current count."""
        return self._threads

    @property
    def source(self) -> str:
        """``"argument"``, ``"OMP_NUM_THREADS"`` or ``"auto"``."""
        return self._source

    @property
    def adaptive(self) -> bool:
        """Whether the count follows the free cores."""
        return self._fixed is None

    def initial(self) -> int:
        """The count to start with, when the engine is built: :meth:`check` over the window since construction
        (the model's load); if that window is too short to read (an already loaded model), the count the
        process's last reading chose, or else one :data:`FIRST_WINDOW_S` window."""
        n = self.check()
        if self._fixed is not None or self.checks:
            return n
        if self._reader is read_cpu_times and "count" in _recent:
            self._threads = min(self._cores, _recent["count"])
            return self._threads
        self._sleep(FIRST_WINDOW_S)
        return self.check()

    def check(self) -> int:
        """Re-read the free cores now (since the last reading) and return the count to use. O(1)."""
        if self._fixed is not None:
            return self._fixed
        cur = self._reader()
        self._last_t = self._clock()
        if cur is None or self._last is None:
            self._last = cur
            return self._threads
        others = others_cores(self._last, cur, self._ncpu)
        if others is None:  # too short a window: keep it and wait for more ticks
            return self._threads
        self._last = cur
        self.checks += 1
        self._threads = pick_threads(others, self._cores, self._ncpu)
        if self._reader is read_cpu_times:
            _recent["count"] = self._threads
        return self._threads

    def tick(self) -> int | None:
        """Called once per engine step: the new count when a re-check (every ``recheck_s`` seconds) changed it,
        else ``None``. One clock read when no re-check is due. After more than :data:`STALE_S` seconds without a
        step the window restarts instead (its average would describe the idle time), the count kept until the
        next re-check."""
        if self._fixed is not None:
            return None
        idle = self._clock() - self._last_t
        if idle < self._recheck_s:
            return None
        if idle > STALE_S:  # the engine was idle (a server between requests): that window says little of now
            self._last, self._last_t = self._reader(), self._clock()
            return None
        before = self._threads
        after = self.check()
        return after if after != before else None


def openmp_runtimes(maps_path: str = "/proc/self/maps") -> list[str]:
    """The OpenMP runtime libraries mapped into this process (paths of ``libgomp``, ``libiomp``, ``libomp``). One
    ``libgomp.so.1`` expected: the kernels' resolves to the one torch loaded (same soname; measured with torch
    2.13's wheel). Wheels may bring renamed copies for their own code (sentencepiece's ``libgomp-<hash>.so``).
    Empty where /proc cannot be read."""
    try:
        with open(maps_path) as f:
            paths = {line.split()[-1] for line in f if "omp" in line and "/" in line}
    except OSError:
        return []
    names = ("libgomp", "libiomp", "libomp")
    return sorted(p for p in paths if os.path.basename(p).startswith(names))
