"""Issue 34 item 3: every tier option of ``pagedkv serve`` is checked before the model loads, each error one line
naming the flag and the fix (exit status 2): a file, an unwritable empty directory, an uncreatable path as
``--kv-disk-dir``; ``--kv-disk-gib 0.0005``; two servers on one directory (pointing to ``--kv-shared``); a
``--kv-shared`` URL of the wrong form. A read-only pre-filled disk tier is served read-only (no lock file
written; loads hit; puts refused). An unreachable ``--kv-shared redis://`` is reported at start-up with a
warning line (and served around). ``--kv-disk-gib`` has a default. Without the model: ``check_options`` and
``main`` (which stops before it would load it)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess

import numpy as np
import pytest

from pagedkv.server.cli import build_parser, check_options, main
from pagedkv.server.tier_checks import DEFAULT_DISK_GIB, tier_settings_line
from pagedkv.tiers import BlockStore, DiskBackend, ModelFingerprint, PutStatus, TierInUseError, codec
import pagedkv

FP = ModelFingerprint("test-model", "float32", 16, "L2,2,B,H1,D8")
PB = 1024


def args_of(*argv):
    return build_parser().parse_args(list(argv))


def serve_error(capsys, *argv) -> str:
    """``pagedkv serve ARGV``'s error line: exit status 2 before the model loads (the port is 0: any)."""
    rc = main(["--port", "0", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = [ln for ln in err.splitlines() if ln.startswith("pagedkv serve: error:")]
    assert len(line) == 1, err
    return line[0]


@contextlib.contextmanager
def unwritable(path, monkeypatch):
    """``path`` made unwritable for real where this user can (root: ``chattr +i``, immutable; others: mode
    0555), else by making ``os.access`` say so. Restored after."""
    path = str(path)
    undo = None
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", path], capture_output=True).returncode == 0:
            undo = ["chattr", "-i", path]
    else:
        os.chmod(path, 0o555)
    try:
        probe = os.path.join(path, "probe")
        try:
            open(probe, "w").close()
            os.unlink(probe)
            writable = True
        except OSError:
            writable = False
        if writable:  # (root on a filesystem without chattr: the permission answer is simulated)
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if str(p) == path and m & os.W_OK
                                else real(p, m, *a, **k))
        yield
    finally:
        if undo:
            subprocess.run(undo, check=True)
        else:
            os.chmod(path, 0o755)


def test_a_file_as_the_disk_dir_names_the_flag(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    line = serve_error(capsys, "--kv-disk-dir", str(f))
    assert "--kv-disk-dir" in line and "give a directory" in line and "Errno" not in line


def test_a_path_under_a_file_names_the_flag(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    line = serve_error(capsys, "--kv-disk-dir", str(f / "sub"))
    assert "--kv-disk-dir" in line and "give a directory" in line


def test_an_unwritable_empty_dir_names_the_flag_and_the_fix(tmp_path, capsys, monkeypatch):
    d = tmp_path / "ro"
    d.mkdir()
    with unwritable(d, monkeypatch):
        line = serve_error(capsys, "--kv-disk-dir", str(d), "--kv-disk-gib", "1")
    assert "--kv-disk-dir" in line and "cannot be written" in line and "make it writable" in line
    assert ".lock" not in line


def test_a_tiny_bound_names_the_flag(tmp_path, capsys):
    line = serve_error(capsys, "--kv-disk-dir", str(tmp_path), "--kv-disk-gib", "0.0005")
    assert "--kv-disk-gib" in line and "kv_disk_gib" not in line and "one KV block" in line


def test_two_servers_on_one_dir_point_to_the_shared_tier(tmp_path, capsys):
    held = DiskBackend(tmp_path, 1 << 20)  # another server holds it
    try:
        line = serve_error(capsys, "--kv-disk-dir", str(tmp_path), "--kv-disk-gib", "1")
        assert "in use by another pagedkv server" in line and "--kv-shared file:///" in line
        assert "DiskBackend" not in line and "TierInUseError" not in line
        with pytest.raises(TierInUseError) as e:  # (the library's error: no internal class named either)
            DiskBackend(tmp_path, 1 << 20)
        assert "DiskBackend" not in str(e.value) and "--kv-shared" in str(e.value)
    finally:
        held.close()


def test_shared_url_forms_and_bounds(tmp_path, capsys):
    assert "--kv-shared" in serve_error(capsys, "--kv-shared", "http://x")
    assert "--kv-shared-gib" in serve_error(capsys, "--kv-shared", f"file://{tmp_path}", "--kv-shared-gib", "0")
    assert "--kv-shared-gib" in serve_error(capsys, "--kv-shared-gib", "3")
    from pagedkv.engine.kv_tiers import open_shared_backend
    from pagedkv.server.tier_checks import shared_url

    a = args_of("--kv-shared", "redis://127.0.0.1:1/0", "--kv-shared-gib", "2")
    assert shared_url(a) == "redis://127.0.0.1:1/0?max_gib=2"
    b = open_shared_backend(shared_url(a))  # (a bound of our own; nothing connects until used)
    assert b.max_bytes == 2 * 2**30 and b.location == "redis://127.0.0.1:1/0#pagedkv:kv:"
    b.close()
    f = tmp_path / "f"
    f.write_text("x")
    assert "--kv-shared" in serve_error(capsys, "--kv-shared", f"file://{f}")
    a = args_of("--kv-shared", f"file://{tmp_path}")
    check_options(a)
    assert a.kv_shared_gib == 10.0


def test_defaults_and_the_settings_line(tmp_path):
    a = args_of("--kv-disk-dir", str(tmp_path / "new"))
    check_options(a)  # --kv-disk-gib has a default: 10 GiB, or half the free space when less
    assert 0 < a.kv_disk_gib <= DEFAULT_DISK_GIB
    line = tier_settings_line(a)
    assert "role both" in line and f"disk tier {tmp_path / 'new'}" in line and "store policy through" in line
    assert "no storage tier" in tier_settings_line(args_of())


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_unreachable_redis_is_reported_at_start_up(caplog):
    pytest.importorskip("redis")
    caplog.set_level(logging.WARNING, logger="pagedkv.server")
    url = f"redis://127.0.0.1:{_free_port()}"  # nothing listens there
    check_options(args_of("--kv-shared", url))  # not an error: served around, as at run time
    assert any("--kv-shared" in r.getMessage() and "does not answer" in r.getMessage() for r in caplog.records)


def test_a_read_only_prefilled_tier_is_served_read_only(tmp_path, monkeypatch, caplog):
    ks = pagedkv.block_hashes(list(range(64)), 16)
    vals = [np.full(PB // 4, i, np.float32) for i in range(len(ks))]
    b = DiskBackend(tmp_path, 1 << 20)
    s = BlockStore(b, FP, PB)
    assert s.put_many(ks, vals) == (PutStatus.STORED,) * 4
    b.close()
    os.unlink(tmp_path / ".lock")  # (a tier copied somewhere read-only need not have one)
    caplog.set_level(logging.WARNING, logger="pagedkv.server")
    with unwritable(tmp_path, monkeypatch):
        a = args_of("--kv-disk-dir", str(tmp_path), "--kv-disk-gib", "1")
        check_options(a)  # not an error: a pre-filled tier, served read-only
        assert a.kv_disk_read_only and "read-only" in tier_settings_line(a)
        assert any("read-only" in r.getMessage() for r in caplog.records)
        r1, r2 = DiskBackend(tmp_path, 1 << 20), DiskBackend(tmp_path, 1 << 20)  # no lock: two readers at once
        try:
            assert r1.read_only and r2.read_only and not (tmp_path / ".lock").exists()
            s1 = BlockStore(r1, FP, PB)
            got = s1.get_many(ks)
            assert got.hit_prefix == 4
            assert all(np.array_equal(np.frombuffer(v, np.float32), w) for v, w in zip(got.values, vals))
            other = pagedkv.block_hashes(list(range(100, 116)), 16)
            assert s1.put_many(other, vals[:1]) == (PutStatus.FULL,)
            assert s1.put_many(ks[:1], vals[:1]) == (PutStatus.PRESENT,)
            r1.check_invariants()
        finally:
            r1.close()
            r2.close()
