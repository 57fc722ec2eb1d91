"""vLLM's block hashes computed by pagedkv (pagedkv.cluster.vllm_hash), without vLLM: golden digests printed by
vLLM 0.33's own request block hasher (tests/compat/vllm_side.py hashes; the compat suite compares random cases
live), the canonical CBOR encoder, the event-key form, and the router's options."""

from __future__ import annotations

import pytest

from pagedkv.cluster.vllm_hash import (ALGOS, DEFAULT_SEED, VLLMHasher, VLLMPromptKeys, cbor_canonical,
                                       external_key)

# (algo, seed, tokens, block size, cache_salt, lora, mm) -> vLLM 0.33's digests and NONE_HASH
GOLDEN = [
    (("sha256", None, list(range(1, 10)), 4, None, None, ()),
     ["52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a",
      "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde"],
     "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"),
    (("xxhash_cbor", "42", list(range(1, 10)), 4, "s", ("a", "/p"), (("img", 2, 3),)),
     ["fe4617de02a56e98e3f79a162e7c9457", "454264bc947fa826b8e070f1b68d12e7"],
     "a9d2e63407fce1a26c9dc9d7fa2d7caf"),
    (("sha256_cbor", None, list(range(5, 13)), 4, "tenant", None, ()),
     ["50867bcf02dfb532bbb34406768f14eeacbdb99384926bee867144fea12d500a",
      "f1b2966ec79e96bbc5d808d0ce060d9633ffa1b5d52a99d29e7b98913d3253fe"],
     "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"),
    (("xxhash", "0", list(range(5, 13)), 4, None, None, ()),
     ["71e4504fe0faec465b11aaae9d8ac07b", "e93c8237102f4eb06ca5d195919fce34"],
     "6fb31cc38bba6066183f7f2104b9c051"),
]


@pytest.mark.parametrize("case,digests,none_hash", GOLDEN)
def test_digests_equal_vllm_0_33s(case, digests, none_hash):
    algo, seed, tokens, bs, salt, lora, mm = case
    h = VLLMHasher(algo, seed, bs)
    assert h.none_hash.hex() == none_hash
    got = h.block_digests(tokens, cache_salt=salt, lora=lora, mm=mm)
    assert [d.hex() for d in got] == digests
    if not lora and not mm:
        keys = h.keys(tokens, cache_salt=salt)
        assert keys == [int.from_bytes(bytes.fromhex(d)[-8:], "big") for d in digests]
        assert keys.digests == got and keys.group(3) is keys and keys.hit_blocks == (len(tokens) - 1) // bs


def test_extra_keys_and_chaining_change_the_hashes_as_vllms_rules_say():
    h = VLLMHasher("sha256_cbor", None, 4)
    toks = list(range(12))
    plain = h.block_digests(toks)
    assert len(plain) == 3 and len(h.block_digests(toks[:11])) == 2  # full blocks only
    salted = h.block_digests(toks, cache_salt="t")
    assert all(a != b for a, b in zip(plain, salted))  # the salt on block 0 changes every chained hash
    assert h.block_digests(toks, cache_salt="") == plain  # an empty salt is none, as in vLLM
    # block i = H((parent, tokens, extra)): recompute by hand
    assert plain[0] == h.hash_block(None, toks[:4]) == h.digest((h.none_hash, tuple(toks[:4]), None))
    assert plain[1] == h.digest((plain[0], tuple(toks[4:8]), None))
    assert salted[0] == h.digest((h.none_hash, (0, 1, 2, 3), (("cache_salt", "t"),)))
    assert salted[1] == h.digest((salted[0], (4, 5, 6, 7), None))
    lora = h.block_digests(toks, lora=("ad", "/x"))
    assert lora[1] == h.digest((lora[0], (4, 5, 6, 7), (("lora", "ad", "/x"),)))
    # an image over tokens 3..5 touches blocks 0 and 1, at offsets 3 and -1 from their starts
    mm = h.block_digests(toks, mm=[("img", 3, 3)])
    assert mm[0] == h.digest((h.none_hash, (0, 1, 2, 3), (("mm", "img", 3),)))
    assert mm[1] == h.digest((mm[0], (4, 5, 6, 7), (("mm", "img", -1),)))
    assert mm[2] == h.digest((mm[1], (8, 9, 10, 11), None))
    # the seed is the none hash's
    assert VLLMHasher("sha256", DEFAULT_SEED, 4).block_digests(toks) == VLLMHasher("sha256", None, 4).block_digests(toks)
    assert VLLMHasher("sha256", "1", 4).block_digests(toks) != VLLMHasher("sha256", None, 4).block_digests(toks)


def test_cbor_canonical_encodes_the_hashed_types_in_their_shortest_form():
    assert cbor_canonical(None) == b"\xf6" and cbor_canonical(True) == b"\xf5" and cbor_canonical(False) == b"\xf4"
    assert cbor_canonical(0) == b"\x00" and cbor_canonical(23) == b"\x17" and cbor_canonical(24) == b"\x18\x18"
    assert cbor_canonical(256) == b"\x19\x01\x00" and cbor_canonical(2**32) == b"\x1b" + (2**32).to_bytes(8, "big")
    assert cbor_canonical(-1) == b"\x20" and cbor_canonical(-25) == b"\x38\x18"
    assert cbor_canonical(b"ab") == b"\x42ab" and cbor_canonical("é") == b"\x62\xc3\xa9"
    assert cbor_canonical((1, [2], ())) == b"\x83\x01\x81\x02\x80"
    for bad in (1.5, {1: 2}, 2**64, object()):
        with pytest.raises(TypeError):
            cbor_canonical(bad)


def test_external_key_is_vllms_int_form():
    d = bytes(range(32))
    assert external_key(d) == int.from_bytes(d, "big") & (2**64 - 1) == int.from_bytes(d[-8:], "big")
    assert external_key(5) == 5
    k = VLLMPromptKeys([d], 9, 4)
    assert k == [external_key(d)] and k.hit_blocks == 2


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="unknown vLLM hash algorithm"):
        VLLMHasher("md5")
    for algo in ("xxhash", "xxhash_cbor"):  # vLLM's seed is random then: nothing to predict
        with pytest.raises(ValueError, match="PYTHONHASHSEED"):
            VLLMHasher(algo)
        VLLMHasher(algo, "7")
    for bs in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            VLLMHasher("sha256", None, bs)
    assert set(ALGOS) == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}


def test_router_options_pick_the_scheme():
    from pagedkv.router.cli import build_parser, make_router

    p = build_parser()
    a = p.parse_args(["--backend", "http://127.0.0.1:1", "--hash-scheme", "vllm", "--vllm-hash-algo", "xxhash"])
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        make_router(a)
    a = p.parse_args(["--backend", "http://127.0.0.1:1", "--vllm-hash-seed", "3"])
    with pytest.raises(ValueError, match="need --hash-scheme vllm"):
        make_router(a)
    with pytest.raises(SystemExit):
        p.parse_args(["--backend", "http://127.0.0.1:1", "--vllm-hash-algo", "md5"])


def test_prompt_builder_hashes_in_the_replicas_scheme():
    from pagedkv import block_hashes
    from pagedkv.router.prompt import PromptBuilder

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

    ids = list(range(40))
    body = b'{"model": "m", "prompt": %s, "cache_salt": "t"}' % str(ids).encode()
    h = VLLMHasher("sha256", None, 8)
    got = PromptBuilder(Tok(), 16, h).build("completions", body)
    assert got.hashes == h.keys(ids, cache_salt="t") and len(got.hashes) == 5
    own = PromptBuilder(Tok(), 8).build("completions", body)
    assert own.hashes == block_hashes(ids, 8, "t")


@pytest.mark.parametrize("as_bytes", [False, True])
def test_the_index_keys_vllms_events_as_the_router_keys_prompts(as_bytes):
    """vLLM's events name blocks by the int form of its digests (or the digests themselves): the index meets the
    router's VLLMHasher keys either way, and a prompt's match stops where the replica's blocks do."""
    from pagedkv.cluster import MemoryIndex
    from pagedkv.server.kv_events import BlockRemoved, BlockStored

    h = VLLMHasher("sha256", None, 4)
    toks = list(range(100, 120))
    d = h.block_digests(toks)
    names = d if as_bytes else [external_key(x) for x in d]
    ix = MemoryIndex()
    ix.apply("r", BlockStored(names[:3], None, toks[:12], 4, None, "GPU", None, group_idx=0))
    assert ix.longest_prefix(h.keys(toks)) == {"r": 3}
    assert ix.longest_prefix(h.keys(toks, cache_salt="other")) == {}
    ix.apply("r", BlockRemoved(names[1:2], "GPU", 0))
    assert ix.longest_prefix(h.keys(toks)) == {"r": 1}
