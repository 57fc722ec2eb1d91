"""The tiers' block key and value format: every field of the fingerprint, the namespace and the chained key
change the store name; the value format refuses every corruption, every cut, another version, another
fingerprint and another name; BlockStore validates its arguments before any I/O."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import pagedkv
from pagedkv import InvalidArgumentError
from pagedkv.tiers import BlockStore, GetStatus, ModelFingerprint, PutStatus, check_digests, store_names
from pagedkv.tiers import codec
from pagedkv.tiers.backend import FAILED, Backend

FP = ModelFingerprint("smollm2-135m@q8", "float32", 16, "L30,2,B,H3,D64")


def test_every_fingerprint_field_changes_the_name():
    keys = pagedkv.block_hashes(list(range(64)), 16)
    base = store_names(FP, keys)
    variants = [ModelFingerprint("gemma-3-270m", "float32", 16, "L30,2,B,H3,D64"),
                ModelFingerprint("smollm2-135m@q8", "bfloat16", 16, "L30,2,B,H3,D64"),
                ModelFingerprint("smollm2-135m@q8", "float32", 32, "L30,2,B,H3,D64"),
                ModelFingerprint("smollm2-135m@q8", "float32", 16, "L30,2,B,H1,D64"),
                FP.for_group(1)]
    digests = {FP.digest} | {v.digest for v in variants}
    assert len(digests) == 6 and all(len(d) == 16 for d in digests)
    for v in variants:
        names = store_names(v, keys)
        assert not set(names) & set(base)
    assert store_names(FP, keys) == base  # deterministic
    assert all(len(n) == 32 and int(n, 16) >= 0 for n in base) and len(set(base)) == 4
    # the fingerprint is a value: equal fields, equal digest
    assert ModelFingerprint("smollm2-135m@q8", "float32", 16, "L30,2,B,H3,D64") == FP
    assert FP.for_group(0) == FP and FP.for_group(2).kv_cache_group == 2


def test_the_namespace_changes_the_name_even_for_the_same_chain_key():
    keys = pagedkv.block_hashes(list(range(32)), 16)
    names = {repr(ns): store_names(FP, keys, ns) for ns in (None, "tenant-a", "tenant-b", b"tenant-a", 7, "7")}
    flat = [n for v in names.values() for n in v]
    assert len(set(flat)) == len(flat)


def test_field_encoding_has_no_ambiguity():
    # length-prefixed fields: moving a character from one field to the next changes the digest
    a = ModelFingerprint("ab", "float32", 16, "c")
    b = ModelFingerprint("a", "float32", 16, "bc")
    assert a.digest != b.digest


@pytest.mark.parametrize("kw", [dict(weights=""), dict(dtype="float33"), dict(block_size=0), dict(block_size=True),
                                dict(kv_layout=""), dict(kv_cache_group=-1), dict(weights=3)])
def test_bad_fingerprints_raise(kw):
    args = dict(weights="w", dtype="float32", block_size=16, kv_layout="x")
    args.update(kw)
    with pytest.raises(InvalidArgumentError):
        ModelFingerprint(**args)


def test_bad_keys_and_namespaces_raise():
    with pytest.raises(InvalidArgumentError):
        store_names(FP, [-1])
    with pytest.raises(InvalidArgumentError):
        store_names(FP, [2**64])
    with pytest.raises(InvalidArgumentError):
        store_names(FP, [[1, 2]])
    with pytest.raises(InvalidArgumentError):
        store_names(FP, [1], namespace=1.5)
    with pytest.raises(InvalidArgumentError):
        store_names("fp", [1])
    assert store_names(FP, []) == []
    assert store_names(FP, [2**64 - 1]) == store_names(FP, np.array([2**64 - 1], dtype=np.uint64))


NAME = store_names(FP, [12345])[0]
OTHER = store_names(FP, [54321])[0]
PAYLOAD = bytes(range(200))


def test_value_round_trip_and_layout():
    v = codec.encode(FP.digest, NAME, PAYLOAD)
    assert len(v) == codec.OVERHEAD_BYTES + len(PAYLOAD) == 64 + 200
    assert v[:4] == b"PKVB" and struct.unpack_from("<H", v, 4)[0] == codec.FORMAT_VERSION == 2
    assert v[8:24] == FP.digest and v[24:40] == bytes.fromhex(NAME)
    assert struct.unpack_from("<HQQ", v, 6)[0] == 0 and struct.unpack_from("<QQ", v, 40) == (0, 200)
    assert not codec.has_check(v)
    c = codec.encode(FP.digest, NAME, PAYLOAD, check=2**64 - 3)
    assert struct.unpack_from("<H", c, 6)[0] == 1 and struct.unpack_from("<QQ", c, 40) == (2**64 - 3, 200)
    assert codec.has_check(c) and bytes(codec.decode(c, FP.digest, NAME, 2**64 - 3)[1]) == PAYLOAD
    why, payload = codec.decode(v, FP.digest, NAME)
    assert why is codec.Decoded.OK and bytes(payload) == PAYLOAD and payload.readonly
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    why, payload = codec.decode(codec.encode(FP.digest, NAME, arr), FP.digest, NAME)
    assert np.array_equal(np.frombuffer(payload, np.float32).reshape(3, 4), arr)
    assert codec.decode(codec.encode(FP.digest, NAME, b""), FP.digest, NAME) == (codec.Decoded.OK, b"")


def test_every_single_byte_corruption_is_refused():
    v = codec.encode(FP.digest, NAME, PAYLOAD)
    for i in range(len(v)):
        for bit in (0x01, 0x80):
            bad = bytearray(v)
            bad[i] ^= bit
            why, payload = codec.decode(bytes(bad), FP.digest, NAME)
            assert why is not codec.Decoded.OK and payload is None, (i, bit)


def test_every_cut_and_every_extension_is_refused():
    v = codec.encode(FP.digest, NAME, PAYLOAD)
    for n in range(len(v)):
        assert codec.decode(v[:n], FP.digest, NAME) == (codec.Decoded.CORRUPT, None), n
    assert codec.decode(v + b"\0", FP.digest, NAME) == (codec.Decoded.CORRUPT, None)


def test_other_version_fingerprint_or_name_is_refused():
    v = codec.encode(FP.digest, NAME, PAYLOAD)
    assert codec.decode(v, FP.for_group(1).digest, NAME) == (codec.Decoded.MISMATCH, None)
    assert codec.decode(v, FP.digest, OTHER) == (codec.Decoded.MISMATCH, None)
    # a well-formed value of a future format version (its own valid checksum)
    body = bytearray(v[:-8])
    struct.pack_into("<H", body, 4, codec.FORMAT_VERSION + 1)
    import xxhash
    future = bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body)))
    assert codec.decode(future, FP.digest, NAME) == (codec.Decoded.VERSION, None)


def test_the_check_digest_is_compared_when_the_reader_passes_one():
    v = codec.encode(FP.digest, NAME, PAYLOAD, check=7)
    assert codec.decode(v, FP.digest, NAME)[0] is codec.Decoded.OK  # not asked: not compared
    assert codec.decode(v, FP.digest, NAME, 7)[0] is codec.Decoded.OK
    assert codec.decode(v, FP.digest, NAME, 8) == (codec.Decoded.CHECK, None)  # another prefix's block
    bare = codec.encode(FP.digest, NAME, PAYLOAD)
    assert codec.decode(bare, FP.digest, NAME, 0) == (codec.Decoded.CHECK, None)  # none stored: refused, even 0
    # the name and fingerprint are judged first
    assert codec.decode(v, FP.digest, OTHER, 7) == (codec.Decoded.MISMATCH, None)


def test_a_version_1_value_is_refused_as_another_version():
    # the format before the check digest: a 48-byte header (magic, version 1, flags, fingerprint, name, length)
    head = struct.pack("<4sHH16s16sQ", b"PKVB", 1, 0, FP.digest, bytes.fromhex(NAME), len(PAYLOAD))
    import xxhash
    old = head + PAYLOAD
    old += struct.pack("<Q", xxhash.xxh3_64_intdigest(old))
    assert codec.decode(old, FP.digest, NAME) == (codec.Decoded.VERSION, None)
    assert codec.decode(old[:20], FP.digest, NAME) == (codec.Decoded.VERSION, None)
    b = _Dict()
    s = BlockStore(b, FP)
    (key,) = [12345]
    b.d[NAME] = old
    r = s.get_many([key])
    assert r.statuses == (GetStatus.MISMATCH,) and NAME not in b.d  # refused, counted, dropped
    assert s.stats.mismatched == 1


def test_check_digests_chain_the_whole_prefix_independently_of_the_chain_keys():
    toks = list(range(100, 164))
    c = check_digests(toks, 16)
    assert len(c) == 4 and len(set(c)) == 4 and all(0 <= x < 2**64 for x in c)
    assert c == check_digests(np.array(toks + [1, 2, 3]), 16)  # full blocks only; deterministic
    assert check_digests(toks[:32], 16) == c[:2]  # a prefix's digests are the first ones
    assert check_digests(toks, 16, "t") != c and check_digests(toks, 16, group=1) != c
    other = [7] + toks[1:]  # the first token differs: every later digest differs although blocks 1-3 are equal
    assert all(a != b for a, b in zip(check_digests(other, 16), c))
    assert set(c).isdisjoint(pagedkv.block_hashes(toks, 16))  # not the chain keys
    assert check_digests([], 16) == []
    for bad in (dict(block_size=0), dict(group=-1)):
        with pytest.raises(InvalidArgumentError):
            check_digests(toks, **{"block_size": 16, **bad})
    with pytest.raises(pagedkv.InvalidTokensError):
        check_digests([-1] * 16, 16)


def test_a_forced_chain_key_collision_is_never_served(monkeypatch):
    """Two different prefixes with the same chain keys by construction (the chain hash monkeypatched to ignore
    the tokens): the first one's blocks are stored; the second's load finds values under its own names, intact
    and of its fingerprint, but refuses each (another prefix's check digest), counts it and keeps it."""
    import pagedkv.blocks.prefix_cache as pc

    monkeypatch.setattr(pc, "_xxh3", lambda data, seed=0: (seed * 31 + 7) % 2**64)  # tokens ignored
    a = list(range(200, 264))
    b = list(range(300, 364))
    ka, kb = pagedkv.block_hashes(a, 16), pagedkv.block_hashes(b, 16)
    assert ka == kb  # the collision
    be = _Dict()
    s = BlockStore(be, FP)
    vals = [np.full(8, i, np.int32) for i in range(4)]
    assert s.put_many(ka, vals, checks=check_digests(a, 16)) == (PutStatus.STORED,) * 4
    r = s.get_many(kb, checks=check_digests(b, 16))
    assert r.statuses == (GetStatus.CHECK,) * 4 and r.values == (None,) * 4 and r.hit_prefix == 0
    assert s.stats.check_refused == 4 and s.stats.hits == 0 and len(be.d) == 4  # kept: prefix a's blocks
    assert s.get_many(ka, checks=check_digests(a, 16)).hit_prefix == 4  # the owner still loads them
    # a value stored without a check digest is refused by a checked load, and dropped
    s2 = BlockStore(_Dict(), FP)
    s2.put_many(ka[:1], vals[:1])
    r = s2.get_many(ka[:1], checks=check_digests(a, 16)[:1])
    assert r.statuses == (GetStatus.CHECK,) and s2.backend.d == {}
    with pytest.raises(InvalidArgumentError):
        s.get_many(ka, checks=[1, 2])  # one per key
    with pytest.raises(InvalidArgumentError):
        s.put_many(ka[:1], vals[:1], checks=[2**64])


class _Dict(Backend):
    """An in-memory backend that records the calls it gets."""

    medium = "memory"

    def __init__(self):
        self.d, self.calls = {}, []

    def read_many(self, names):
        self.calls.append("read")
        return [self.d.get(n) for n in names]

    def write_many(self, names, values):
        self.calls.append("write")
        out = []
        for n, v in zip(names, values):
            out.append(PutStatus.PRESENT if n in self.d else PutStatus.STORED)
            self.d.setdefault(n, v)
        return out

    def exists_many(self, names):
        self.calls.append("exists")
        return [n in self.d for n in names]

    def discard_many(self, names):
        self.calls.append("discard")
        for n in names:
            self.d.pop(n, None)


def test_block_store_refuses_bad_arguments_before_any_io():
    b = _Dict()
    s = BlockStore(b, FP, payload_bytes=8)
    keys = pagedkv.block_hashes(list(range(32)), 16)
    with pytest.raises(InvalidArgumentError):
        s.put_many(keys, [b"12345678"])  # count
    with pytest.raises(InvalidArgumentError):
        s.put_many(keys, [b"12345678", b"123"])  # size
    with pytest.raises(InvalidArgumentError):
        s.put_many(keys, [b"12345678", 5])  # not bytes-like
    with pytest.raises(InvalidArgumentError):
        s.put_many(keys, [b"12345678", np.zeros(16, np.uint8)[::2]])  # not contiguous
    with pytest.raises(InvalidArgumentError):
        s.get_many(keys, namespace=2.5)
    with pytest.raises(InvalidArgumentError):
        BlockStore(b, "fp")
    with pytest.raises(InvalidArgumentError):
        BlockStore(object(), FP)
    assert b.calls == [] and s.stats == type(s.stats)()


def test_block_store_answers_per_block_and_counts():
    b = _Dict()
    s = BlockStore(b, FP)
    keys = pagedkv.block_hashes(list(range(64)), 16)
    vals = [np.full(10, i, np.int32) for i in range(4)]
    assert s.put_many(keys[:3], vals[:3]) == (PutStatus.STORED,) * 3
    assert s.put_many(keys[:1], vals[:1]) == (PutStatus.PRESENT,)
    r = s.get_many(keys)
    assert r.statuses == (GetStatus.HIT,) * 3 + (GetStatus.MISS,) and r.hit_prefix == 3
    assert [np.frombuffer(v, np.int32)[0] for v in r.values[:3]] == [0, 1, 2] and r.values[3] is None
    assert s.contains_many(keys) == (True, True, True, False) and s.prefix_length(keys) == 3
    assert s.get_many(keys, namespace="t").statuses == (GetStatus.MISS,) * 4  # another tenant sees nothing
    st = s.stats
    assert (st.gets, st.hits, st.misses, st.puts, st.stored, st.present) == (8, 3, 5, 4, 3, 1)
    assert st.bytes_written == st.bytes_read == 120


def test_a_backend_that_raises_is_answered_as_failed():
    class Broken(_Dict):
        def read_many(self, names):
            raise RuntimeError("boom")

        def write_many(self, names, values):
            raise RuntimeError("boom")

        def exists_many(self, names):
            raise RuntimeError("boom")

    s = BlockStore(Broken(), FP)
    keys = pagedkv.block_hashes(list(range(32)), 16)
    assert s.get_many(keys).statuses == (GetStatus.ERROR,) * 2
    assert s.put_many(keys, [b"a", b"b"]) == (PutStatus.ERROR,) * 2
    assert s.contains_many(keys) == (False, False)
    st = s.stats
    assert st.read_errors == 4 and st.write_errors == 2 and st.hits == 0
    assert FAILED is not None and not FAILED


def test_the_docs_page_example_runs_as_written():
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "tiers.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert blocks
    run = [code for code in blocks if not code.startswith("# (not run by the tests")]
    assert run  # the bottom layer's example, at least
    for code in run:
        exec(compile(code, "docs/tiers.md example", "exec"), {})  # noqa: S102 - the repository's own example


def test_the_tiers_are_torch_free_and_import_redis_only_when_used():
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    code = ("import sys; sys.path.insert(0, %r)\n"
            "import pagedkv.tiers, tempfile\n"
            "s = pagedkv.tiers.BlockStore(pagedkv.tiers.DiskBackend(tempfile.mkdtemp(), 1 << 20),\n"
            "    pagedkv.tiers.ModelFingerprint('m', 'float32', 16, 'x'))\n"
            "s.put_many([1], [b'abc']); assert s.get_many([1]).hit_prefix == 1\n"
            "assert 'torch' not in sys.modules and 'redis' not in sys.modules, sorted(sys.modules)\n") % src
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("namespace", [None, "tenant-a", 7])
def test_chain_next_extends_both_chains_one_block_at_a_time(namespace):
    """chain_roots + chain_next step by step give block_hashes' and check_digests' entries (what the engine uses
    for a block a decode fills: O(block) from its parent's pair, not O(prefix))."""
    from pagedkv.tiers.key import chain_next, chain_roots

    toks = [(i * 7919) % 50000 for i in range(16 * 5 + 3)]
    keys, checks = pagedkv.block_hashes(toks, 16, namespace), check_digests(toks, 16, namespace)
    k, c = chain_roots(namespace)
    for i in range(5):
        k, c = chain_next(k, c, toks[16 * i:16 * (i + 1)])
        assert (k, c) == (keys[i], checks[i])
    assert chain_next(k, c, toks[:16]) != chain_next(k ^ 1, c, toks[:16])
