"""The chain keys and check digests the storage tiers name blocks by (:class:`ChainKeys`): a prompt's, hashed once
when its request is added, and every block a step fills past it (a decode's, a recomputed sequence's), chained
from its parent's in O(1); remembered, bounded, so that a store plan (which names blocks by chain key) can be
written with each block's check digest and parent, and with KV cache groups its group. Used by
:class:`pagedkv.engine.kv_tiers.EngineTiers` on the step loop's thread only (docs/tiers.md#the-engine)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..blocks.prefix_cache import block_hashes
from ..tiers import check_digests
from ..tiers.key import chain_next, chain_roots

__all__ = ["ChainKeys"]

#: the most chain keys whose check digests (pagedkv.tiers.check_digests) are remembered for store plans (oldest
#: dropped; a planned block whose digest is not known is not stored: a load would refuse it without one)
_MAX_CHECK_KEYS = 1 << 18
#: the most sequences (and requests) whose last full block's chain key is remembered, so that the next block a
#: decode fills chains from it in O(1) (oldest dropped: a sequence that lost its entry rebuilds its chain once)
_MAX_TAILS = 1 << 16


class ChainKeys:
    """Chain keys and check digests of the blocks an engine may store (see the module docstring).

    Read by the tiers: ``checks`` (chain key -> check digest), ``parent_keys`` (chain key -> its parent's),
    ``check_group`` (KV cache groups: chain key -> its group); each bounded by ``_MAX_CHECK_KEYS`` per group,
    oldest dropped."""

    def __init__(self, block_size: int, windows: Any = None) -> None:
        self.block_size = int(block_size)
        self.windows = windows
        self.num_groups = 1 if windows is None else len(windows)
        self.checks: dict = {}
        self.parent_keys: dict = {}
        self.check_group: dict = {}
        # sequence id -> (index, chain key) of the last block it filled; request id -> the same for its prompt's
        # last full block (on_blocks_filled chains the next block from there), each bounded by _MAX_TAILS
        self.tails: dict = {}
        self.prompt_tails: dict = {}

    def remember_prompt(self, request_id: Any, token_ids: Any, namespace: Any) -> Any:
        """The chain keys of a new request's prompt (with KV cache groups one list per group), remembered with
        their check digests, parents (and groups) for the store plans, and its last full block's key as the tail
        decode-filled blocks chain from. O(prompt x groups) (a BLAKE2b call per block, ~1 us)."""
        bs = self.block_size
        full = list(token_ids[: len(token_ids) // bs * bs])
        cd = self.checks
        pk = self.parent_keys
        if self.windows is None:
            keys = block_hashes(full, bs, namespace)
            cd.update(zip(keys, check_digests(full, bs, namespace)))
            pk.update(zip(keys[1:], keys[:-1]))
        else:
            keys = [block_hashes(full, bs, namespace, g) for g in range(len(self.windows))]
            cg = self.check_group
            for g, kg in enumerate(keys):
                cd.update(zip(kg, check_digests(full, bs, namespace, group=g)))
                cg.update(dict.fromkeys(kg, g))
                pk.update(zip(kg[1:], kg[:-1]))
            while len(cg) > _MAX_CHECK_KEYS * len(self.windows):
                del cg[next(iter(cg))]
        while len(cd) > _MAX_CHECK_KEYS * self.num_groups:
            del cd[next(iter(cd))]
        while len(pk) > _MAX_CHECK_KEYS * self.num_groups:
            del pk[next(iter(pk))]
        if self.windows is None:
            if keys:
                _remember(self.prompt_tails, request_id, (len(keys) - 1, keys[-1]))
        elif keys[0]:  # (KV cache groups: every group's last key, one chain per group)
            _remember(self.prompt_tails, request_id, (len(keys[0]) - 1, tuple(kg[-1] for kg in keys)))
        return keys

    def on_blocks_filled(self, plan: Any, scheduler: Any, by_id: dict) -> None:
        """Before a step's store plan is taken: the check digest of every block a sequence fills in this step past
        its prompt's full blocks (a decode's block, or a recomputed sequence's generated tokens), chained from its
        parent's (:func:`~pagedkv.tiers.key.chain_next`) and remembered with the prompts' digests, so that a store
        plan stores decode-filled blocks too. O(1) per filled block (the block's tokens, one xxh3 and one BLAKE2b
        call) plus a vectorised pass over the decode's positions; a sequence whose parent is not remembered
        (more than ``_MAX_TAILS`` sequences since) rebuilds its chain once, O(its tokens). With KV cache groups
        every group's chain is extended (each from its own root, :func:`~pagedkv.tiers.key.chain_roots` with its
        group) and each key remembered with its group, so that a store plan stores every group's decode-filled
        blocks under its group's fingerprint: O(groups) per filled block."""
        bs = self.block_size
        fills = []  # (seq_id, block index)
        d = plan.decode
        if d is not None:
            pos = d.positions
            ends = (pos + 1) % bs == 0
            if ends.any():
                owners = np.repeat(d.seq_ids, d.query_lens)
                fills += zip(owners[ends].tolist(), ((pos[ends] + 1) // bs - 1).tolist())
        for pw in plan.prefills:  # (a recomputed sequence's prefill runs over its generated tokens too)
            r = by_id.get(pw.request_id)
            if r is None or pw.seq_len <= len(r.prompt_token_ids):
                continue
            start = int(pw.positions[0]) if pw.positions.size else pw.seq_len
            first = max(len(r.prompt_token_ids) // bs, -(-(start + 1) // bs) - 1)
            fills += [(pw.seq_id, j) for j in range(first, pw.seq_len // bs)]
        for sid, j in fills:
            view = scheduler.sequence(sid)
            r = by_id.get(view.request_id)
            if r is not None and j >= view.prompt_len // bs:  # (a prompt's full blocks are known since on_add)
                self._fill(sid, j, r, view.output)

    def _fill(self, sid: Any, j: int, r: Any, output: tuple) -> None:
        """Chain block ``j`` of sequence ``sid`` (every group's key and check digest with KV cache groups) from its
        parent's, remembered for the store plans; ``_tails[sid]`` then holds ``(j, key)`` (with groups ``(j,
        keys)``, one per group)."""
        bs, cd = self.block_size, self.checks
        prompt = r.prompt_token_ids
        plen = len(prompt)
        ng = None if self.windows is None else len(self.windows)

        def tokens(a: int, z: int) -> list:
            return list(prompt[a:z]) + list(output[max(a - plen, 0):z - plen]) if z > plen else list(prompt[a:z])

        gs = [0] if ng is None else range(ng)
        parents = None  # per group (key, check) of block j - 1
        if j == 0:
            parents = [chain_roots(r.namespace, g) for g in gs]
        else:
            for tail in (self.tails.get(sid), self.prompt_tails.get(r.request_id)):
                if tail is not None and tail[0] == j - 1:
                    ks = (tail[1],) if ng is None else tail[1]
                    cs = [cd.get(k) for k in ks]
                    if None not in cs and len(ks) == len(gs):
                        parents = list(zip(ks, cs))
                        break
        if parents is None:  # (its parent is no longer remembered: the chain rebuilt from its tokens, once)
            head = tokens(0, j * bs)
            parents = []
            for g in gs:
                keys, checks = block_hashes(head, bs, r.namespace, g), check_digests(head, bs, r.namespace, g)
                cd.update(zip(keys, checks))
                if ng is not None:
                    self.check_group.update(dict.fromkeys(keys, g))
                parents.append((keys[-1], checks[-1]))
        block = tokens(j * bs, (j + 1) * bs)
        made = []
        for g, (pk, pc) in zip(gs, parents):
            key, c = chain_next(pk, pc, block)
            cd[key] = c
            self.parent_keys[key] = None if j == 0 else pk
            if ng is not None:
                self.check_group[key] = g
            made.append(key)
        while len(cd) > _MAX_CHECK_KEYS * len(made):
            del cd[next(iter(cd))]
        pkd = self.parent_keys
        while len(pkd) > _MAX_CHECK_KEYS * len(made):
            del pkd[next(iter(pkd))]
        if ng is not None:
            cg = self.check_group
            while len(cg) > _MAX_CHECK_KEYS * ng:
                del cg[next(iter(cg))]
        _remember(self.tails, sid, (j, made[0] if ng is None else tuple(made)))


def _remember(d: dict, k: Any, v: Any) -> None:
    """``d[k] = v`` as its newest entry, the oldest dropped past ``_MAX_TAILS``. O(1)."""
    d.pop(k, None)
    d[k] = v
    if len(d) > _MAX_TAILS:
        del d[next(iter(d))]
