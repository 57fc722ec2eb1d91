"""``pagedkv serve``'s checks of the storage tier options, before the model loads (issue 34).

Each error is one line naming the flag and the fix; nothing is created or written but the disk tier's directory
(when absent) and a probe file. What is checked:

- ``--kv-disk-dir``: a file there, a path that cannot be created, a directory that is not readable: errors. A
  directory that exists and cannot be written (read-only filesystem, permissions, ``chattr +i``): served
  **read-only** when it holds KV values (a pre-filled tier: loads only, nothing stored or evicted, no lock
  taken; a warning says so), an error when it holds none. A directory another server holds (its lock): an error
  pointing to ``--kv-shared`` for sharing.
- ``--kv-disk-gib``: default :data:`DEFAULT_DISK_GIB` GiB, or half the filesystem's free space when that is
  less; below :data:`MIN_DISK_GIB` (no model's block fits): an error; above the free space: a warning.
- ``--kv-shared``: the URL's form; ``file:///DIR`` as a disk directory (it must be writable), bounded by
  ``--kv-shared-gib`` (default :data:`DEFAULT_SHARED_GIB`; for Redis no default: the server's ``maxmemory``);
  ``redis://`` probed with one PING (a short timeout):
  a store that does not answer is reported with a warning line and served around (blocks are computed; the tier
  retries every second and is used as soon as it answers).

:func:`tier_settings_line` is the start-up log line of the tier and role settings.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import logging
import os
import shutil
from urllib.parse import urlparse

__all__ = ["DEFAULT_DISK_GIB", "DEFAULT_SHARED_GIB", "MIN_DISK_GIB", "add_tier_args", "check_tier_options",
           "tier_settings_line"]

log = logging.getLogger("pagedkv.server")

#: ``--kv-disk-gib`` when not given (or half the free space of the directory's filesystem, when less)
DEFAULT_DISK_GIB = 10.0
#: ``--kv-shared-gib`` when not given: the bound of a ``file://`` shared tier
DEFAULT_SHARED_GIB = 10.0
#: the least ``--kv-disk-gib`` / ``--kv-shared-gib`` accepted (1 MiB: a KV block of the registry models in
#: float32 with 16-token blocks is 0.56-0.70 MiB)
MIN_DISK_GIB = 1 / 1024


def add_tier_args(p: argparse.ArgumentParser) -> None:
    """The serve-only tier options (the engine's own are in :func:`pagedkv.engine.options.add_engine_args`)."""
    p.add_argument("--kv-shared-gib", type=float, default=None, metavar="GIB",
                   help=f"the bound of the --kv-shared tier in GiB: past it the replica that writes deletes "
                        f"values, a chain's tail before its head (file:///DIR: default {DEFAULT_SHARED_GIB:g}; "
                        "redis://: default none, the server's maxmemory and its LRU)")


def _values_in(d: str) -> int:
    """How many KV value files the directory holds (stops counting at 1: O(folders) at most)."""
    try:
        for sub in os.scandir(d):
            if sub.is_dir(follow_symlinks=False) and len(sub.name) == 2:
                for e in os.scandir(sub.path):
                    if e.name.endswith(".kv"):
                        return 1
    except OSError:
        return 0
    return 0


def _dir_error(flag: str, path: str, e: OSError) -> ValueError:
    if isinstance(e, NotADirectoryError) or e.errno == errno.ENOTDIR:
        return ValueError(f"{flag} {path}: {e.strerror or 'not a directory'} ({e.filename}); give a directory "
                          "(created if absent)")
    return ValueError(f"{flag} {path}: {e.strerror or e} ({e.filename}); give a directory this user can create "
                      "and write, e.g. under $HOME")


def _free_gib(path: str) -> float | None:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free / 2**30
    except OSError:
        return None


def _check_gib(flag: str, gib: float) -> None:
    if not MIN_DISK_GIB <= gib < float("inf"):
        raise ValueError(f"{flag} must be a finite number of GiB >= {MIN_DISK_GIB:.6f} (1 MiB: one KV block must "
                         f"fit), got {gib:g}; e.g. {flag} {DEFAULT_DISK_GIB:g}")


def _check_disk_dir(args: argparse.Namespace) -> None:
    from ..tiers.disk import open_mode

    d = args.kv_disk_dir
    try:
        mode = open_mode(d)
    except OSError as e:
        raise _dir_error("--kv-disk-dir", d, e) from None
    args.kv_disk_read_only = mode == "ro"
    if mode == "ro":
        if not _values_in(d):
            raise ValueError(f"--kv-disk-dir {d}: the directory cannot be written (read-only filesystem, "
                             "permissions or immutable) and holds no KV blocks to serve; make it writable or give "
                             "another directory")
        log.warning("pagedkv serve: --kv-disk-dir %s cannot be written: its KV blocks are served read-only (loads "
                    "only; nothing is stored or evicted)", d)
    else:
        try:
            os.makedirs(d, exist_ok=True)
            fd = os.open(os.path.join(d, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _dir_error("--kv-disk-dir", d, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(f"--kv-disk-dir {d} is in use by another pagedkv server (one server per directory): "
                             "give each server its own --kv-disk-dir, or share KV blocks between servers with "
                             "--kv-shared file:///DIR (or redis://HOST:PORT)") from None
        finally:
            os.close(fd)  # (closing releases the probe's lock)
    free = _free_gib(d)
    if args.kv_disk_gib is None:
        args.kv_disk_gib = DEFAULT_DISK_GIB if free is None else max(MIN_DISK_GIB, min(DEFAULT_DISK_GIB, free / 2))
    else:
        _check_gib("--kv-disk-gib", args.kv_disk_gib)
        if free is not None and mode == "rw" and args.kv_disk_gib > free:
            log.warning("pagedkv serve: --kv-disk-gib %g is more than the %.1f GiB free under %s: the tier stops "
                        "storing when the disk is full", args.kv_disk_gib, free, d)


def _check_shared(args: argparse.Namespace) -> None:
    url = args.kv_shared
    u = urlparse(url)
    gib = getattr(args, "kv_shared_gib", None)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost") or not u.path or u.query:
            raise ValueError(f"--kv-shared must be file:///ABSOLUTE/DIR, got {url!r}")
        from ..tiers.disk import open_mode

        try:
            mode = open_mode(u.path)
        except OSError as e:
            raise _dir_error("--kv-shared", url, e) from None
        if mode == "ro":
            raise ValueError(f"--kv-shared {url}: the directory cannot be written (read-only filesystem, "
                             "permissions or immutable); every replica writes the shared tier: make it writable")
        gib = DEFAULT_SHARED_GIB if gib is None else gib
        _check_gib("--kv-shared-gib", gib)
        args.kv_shared_gib = gib
        return
    if gib is not None:  # (a Redis store: a bound of our own besides its maxmemory)
        _check_gib("--kv-shared-gib", gib)
    _probe_redis(url)


def _probe_redis(url: str, timeout: float = 0.5) -> bool:
    """One PING; a warning line when the store does not answer (served around: blocks are computed)."""
    try:
        import redis
    except ImportError:
        raise ValueError("--kv-shared redis://... needs the redis package: pip install 'pagedkv[router]'") from None
    try:
        c = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    except ValueError as e:
        raise ValueError(f"--kv-shared {url!r}: {e}") from None
    try:
        c.ping()
        return True
    except (redis.RedisError, OSError) as e:
        log.warning("pagedkv serve: --kv-shared %s does not answer (%s: %s); serving without it (KV blocks are "
                    "computed) and retrying every second: it is used as soon as it answers", url,
                    type(e).__name__, e)
        return False
    finally:
        try:
            c.close()
        except Exception:  # noqa: BLE001
            pass


def check_tier_options(args: argparse.Namespace) -> None:
    """Check (and complete: the defaults of ``--kv-disk-gib`` / ``--kv-shared-gib``) the tier options; a
    ValueError with a one-line message naming the flag and the fix. Before the model loads; O(1) but for a
    directory probe and a Redis PING (0.5 s at most)."""
    kv_dir, kv_gib, kv_shared = (getattr(args, n, None) for n in ("kv_disk_dir", "kv_disk_gib", "kv_shared"))
    args.kv_disk_read_only = False
    if kv_gib is not None and kv_dir is None:
        raise ValueError("--kv-disk-gib needs --kv-disk-dir DIR (the disk tier's directory)")
    if kv_dir is not None:
        _check_disk_dir(args)
    if kv_shared is not None:
        if not isinstance(kv_shared, str) or urlparse(kv_shared).scheme not in ("redis", "rediss", "unix", "file"):
            raise ValueError(f"--kv-shared must be redis://HOST:PORT or file:///DIR, got {kv_shared!r}")
        _check_shared(args)
    elif getattr(args, "kv_shared_gib", None) is not None:
        raise ValueError("--kv-shared-gib needs --kv-shared file:///DIR")


def shared_url(args: argparse.Namespace) -> str | None:
    """The ``kv_shared`` URL handed to the engine: a ``file://`` one carries its bound (``?max_gib=``)."""
    url = getattr(args, "kv_shared", None)
    gib = getattr(args, "kv_shared_gib", None)
    if url is None or gib is None:
        return url
    return f"{url}{'&' if urlparse(url).query else '?'}max_gib={gib:g}"


def tier_settings_line(args: argparse.Namespace) -> str:
    """One line of the tier and role settings, logged at start-up."""
    parts = [f"role {args.kv_role}"]
    if getattr(args, "kv_disk_dir", None):
        ro = " read-only" if getattr(args, "kv_disk_read_only", False) else ""
        parts.append(f"disk tier {args.kv_disk_dir} ({args.kv_disk_gib:g} GiB{ro})")
    if getattr(args, "kv_shared", None):
        gib = getattr(args, "kv_shared_gib", None)
        parts.append(f"shared tier {args.kv_shared}" + (f" ({gib:g} GiB)" if gib else ""))
    if getattr(args, "kv_disk_dir", None) or getattr(args, "kv_shared", None):
        policy = getattr(args, "kv_store_policy", None) or ("through" if getattr(args, "kv_store", True) else "off")
        ms = getattr(args, "kv_load_max_ms_per_block", None)
        parts.append(f"store policy {policy}, load when under {ms:g} ms per block" if ms else
                     f"store policy {policy}, always load")
    else:
        parts.append("no storage tier")
    if args.kv_role != "both":
        parts.append(f"lease {args.kv_lease:g} s, store wait {args.kv_store_wait:g} s")
    return "pagedkv serve: KV " + "; ".join(parts)
