"""A throwaway redis-server for tests: a free port on 127.0.0.1, no persistence, stopped afterwards.

``redis_url`` (a pytest fixture factory, see :func:`start`) skips the test with a clear reason when the
``redis-server`` binary (Debian package ``redis-server``) or the ``redis`` Python package is absent.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``port``: a given one (to start Redis again where a killed one was), or a free one."""

    def __init__(self, tmpdir, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (Debian package redis-server; scripts/setup.sh installs it)")
        try:
            import redis  # noqa: F401
        except ImportError:
            pytest.skip("the redis Python package is not installed (pip install 'pagedkv[router]')")
        self.port = port if port is not None else free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmpdir), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no save."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
