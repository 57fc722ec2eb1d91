"""Shared test helpers: this file puts tests/ on sys.path (pytest's prepend import mode), so test modules in any
folder import ``redis_server`` (a throwaway redis-server for the Redis-index tests)."""

import pytest


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """URL of a redis-server started for this module (skipped with a reason when the binary is absent)."""
    from redis_server import RedisServer

    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    yield srv.url
    srv.stop()
