"""Anchor: vLLM V1's ``vllm.v1.core.kv_cache_manager.KVCacheManager`` (tested with vllm 0.33.0).

Loading.  The KV-cache manager, ``vllm.v1.request.Request`` and ``vllm.sampling_params`` are loaded
from the installed wheel unchanged; what their imports drag in from the rest of the engine is cut off:

* bare packages (``__init__`` skipped, submodules load normally): ``vllm``, ``vllm.distributed``
  (its ``__init__`` builds the tensor-parallel machinery; only ``kv_events`` is needed),
  ``vllm.multimodal`` (PIL, media loaders), ``vllm.v1.structured_output`` (grammar backends, the
  OpenAI protocol models; only its ``request`` module is needed), ``vllm.config`` (every config class,
  transformers) and ``vllm.tokenizers`` (transformers);
* stand-in names on those bare packages, used only in annotations: ``vllm.config.VllmConfig``,
  ``ModelConfig``, ``PoolerConfig``, ``SpeculativeConfig``, ``StructuredOutputsConfig``, and
  ``vllm.tokenizers.TokenizerLike``; plus ``vllm.config.get_current_vllm_config_or_none``, which
  returns None as vLLM's does when no engine config is set;
* stub modules: ``vllm.compilation.cuda_graph`` (``CUDAGraphStat``, an annotation in the metrics
  module), ``vllm.multimodal.inputs`` (multimodal types, annotations) and ``vllm.multimodal.utils``
  (two functions reached only for multimodal requests; the stubs raise).

Per decode step, the KV-cache-manager calls of vLLM V1's ``Scheduler.schedule()`` (and of
``update_from_output``) for a running decode batch, which is exactly what
:meth:`VllmV1Anchor.decode_step` times:

1. ``new_step_starts()`` once;
2. per request ``allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)`` (V1 returns None
   instead of raising when the pool is short; the scheduler would then preempt: the adapter raises
   ``AnchorOutOfBlocks``), then ``new_blocks.get_block_ids(allow_none=True)`` as
   ``_make_cached_request_data`` does (V1 sends only the new block ids to its workers);
3. once: ``take_boundary_state_offloads()``, ``take_kv_cache_block_copies()``,
   ``take_new_block_ids()`` and ``take_events()``.

Engine-side work outside ``decode_step``, in :meth:`VllmV1Anchor.prepare_step` (= :meth:`~VllmV1Anchor.stage`,
the adapter's own bookkeeping, then :meth:`~VllmV1Anchor.update_requests`, V1's engine work):
``request.num_computed_tokens`` is advanced over the tokens scheduled in the previous step
(``_update_after_schedule``) and the sampled token is appended with ``Request.append_output_token_ids``
(``update_from_output``).  With prefix caching V1 hashes a block that has just become full inside
``append_output_token_ids`` (the request's block hasher), whereas vLLM v2, nano-vllm and pagedkv hash inside
their block-manager calls: the side-by-side benchmarks (``pagedkv bench hybrid`` and ``sweep``) therefore
time ``update_requests`` as part of V1's step.

A request is admitted as V1's waiting-queue path does: ``get_computed_blocks(request)`` then
``allocate_slots(request, num_new_tokens, num_new_computed_tokens=..., new_computed_blocks=...,
full_sequence_must_fit=True, has_scheduled_reqs=...)`` and ``get_blocks(request_id)``.

The pool has ``num_gpu_blocks + 1`` blocks, because V1 keeps block 0 as its null block, so that the
usable count matches pagedkv's.

Hybrid configuration (``kv_cache_groups=``).  A list of group specs (pagedkv's
:class:`pagedkv.FullAttentionSpec` / :class:`pagedkv.SlidingWindowSpec`, or anything with a ``window``
attribute that is None for full attention) becomes one V1 ``KVCacheGroupSpec`` per group
(``layers_per_group`` layer names each, every group the same page size) over one ``KVCacheConfig`` pool, as
V1's ``_get_kv_cache_config_uniform_page_size`` builds it for Gemma 3; ``KVCacheManager`` then picks its
``HybridKVCacheCoordinator`` itself (with prefix caching; without it the no-cache coordinator, which handles
the groups too).  The calls are the same as for one group; ``get_block_ids(allow_none=True)`` then holds one
list of new ids per group, and :meth:`VllmV1Anchor.block_table` takes the group.  V1 gives a sliding group
blocks for the whole prompt at admission and releases those outside the window at the request's next
``allocate_slots`` (which first calls ``remove_skipped_blocks``); :meth:`VllmV1Anchor.settle` makes that
release for an admitted request (``KVCacheManager.remove_skipped_blocks``, the call V1's scheduler makes),
so a benchmark can admit a thousand long prompts one after another into a pool sized for their windows.  Block hashes use vLLM's default ``sha256`` prefix-caching hash.
Not supported: fork (V1 runs parallel samples as separate requests sharing the prefix cache), swap
(V1 preempts by recompute or offloads through KV connectors), copy-on-write.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from typing import Any

from ._base import AllocStatus, AnchorAdapter, AnchorOutOfBlocks, AnchorStep, token_rows
from ._shim import bare_package, inert_class, package_dir, stub_module, unsupported

__all__ = ["VllmV1Anchor", "VLLM_VERSION"]

_CONFIG_NAMES = ("VllmConfig", "ModelConfig", "PoolerConfig", "SpeculativeConfig", "StructuredOutputsConfig")
_MM_INPUT_NAMES = (
    "MultiModalFeatureSpec",
    "BaseMultiModalField",
    "MultiModalBatchedField",
    "MultiModalFieldConfig",
    "MultiModalFieldElem",
    "MultiModalFlatField",
    "MultiModalKwargsItem",
    "MultiModalKwargsItems",
    "MultiModalSharedField",
    "NestedTensors",
)


def _load() -> dict[str, Any]:
    root = package_dir("vllm")
    if root is None:
        raise ImportError("vllm is not installed")
    if not os.path.exists(os.path.join(root, "v1", "core", "kv_cache_manager.py")):
        raise ImportError(f"the vllm installed at {root} has no vllm/v1/core/kv_cache_manager.py")
    bare_package("vllm", root)
    for pkg in ("vllm.distributed", "vllm.multimodal", "vllm.v1.structured_output"):
        bare_package(pkg, root)
    config_names: dict[str, Any] = {n: inert_class(n, "vllm.config") for n in _CONFIG_NAMES}
    config_names["get_current_vllm_config_or_none"] = lambda: None
    bare_package("vllm.config", root, config_names)
    bare_package("vllm.tokenizers", root, {"TokenizerLike": inert_class("TokenizerLike", "vllm.tokenizers")})
    stub_module("vllm.compilation.cuda_graph", ["CUDAGraphStat"])
    stub_module("vllm.multimodal.inputs", _MM_INPUT_NAMES)
    stub_module(
        "vllm.multimodal.utils",
        {
            n: unsupported(f"vllm.multimodal.utils.{n}", "multimodal requests are not supported by the anchor")
            for n in ("get_mm_features_in_window", "strip_covered_mm_data")
        },
    )

    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request, RequestStatus

    return dict(
        torch=torch,
        SamplingParams=SamplingParams,
        sha256=sha256,
        KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher,
        init_none_hash=init_none_hash,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        Request=Request,
        RequestStatus=RequestStatus,
    )


_V = _load()
Request = _V["Request"]
RequestStatus = _V["RequestStatus"]
KVCacheManager = _V["KVCacheManager"]

try:
    from importlib.metadata import version as _dist_version

    VLLM_VERSION = _dist_version("vllm")
except Exception:  # pragma: no cover
    VLLM_VERSION = "unknown"

_none_hash_ready = False


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class VllmV1Anchor(AnchorAdapter):
    """vLLM V1 KVCacheManager behind the pagedkv BlockManager subset (see the module docstring)."""

    name = f"vllm-v1 {VLLM_VERSION}"
    supports = frozenset({"prefix_caching", "lookahead", "sliding_window", "eviction_order"})
    missing = (
        "fork and copy-on-write (V1 runs parallel samples as separate requests), swap (V1 preempts by "
        "recompute); allocate_slots is per request, so a decode step is not all-or-nothing across the batch"
    )

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        watermark: float = 0.01,
        kv_cache_groups: Seq[Any] | None = None,
        layers_per_group: int = 3,
    ) -> None:
        global _none_hash_ready
        if num_cpu_blocks:
            raise NotImplementedError("vLLM V1's KVCacheManager has no CPU swap space")
        torch = _V["torch"]
        common = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
        if kv_cache_groups is not None:
            if sliding_window is not None:
                raise ValueError("give sliding_window or kv_cache_groups, not both")
            if not kv_cache_groups or layers_per_group < 1:
                raise ValueError("kv_cache_groups needs at least one group and layers_per_group >= 1")
            windows = [getattr(g, "window", None) for g in kv_cache_groups]
        else:
            windows = [sliding_window]
        groups = []
        for g, w in enumerate(windows):
            if w is None:
                spec = _V["FullAttentionSpec"](**common)
            else:
                spec = _V["SlidingWindowSpec"](**common, sliding_window=int(w))
            names = [f"model.layers.{g * layers_per_group + j}.self_attn.attn" for j in range(layers_per_group)]
            groups.append(_V["KVCacheGroupSpec"](names if kv_cache_groups is not None else names[:1], spec))
        config = _V["KVCacheConfig"](
            num_blocks=num_gpu_blocks + 1,  # + V1's null block
            kv_cache_tensors=[],
            kv_cache_groups=groups,
        )
        self.num_groups = len(groups)
        self.windows = tuple(windows)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.km = KVCacheManager(
            config,
            max_model_len=num_gpu_blocks * block_size,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=enable_prefix_caching,
            watermark=watermark,
        )
        self._hasher = None
        if enable_prefix_caching:
            sha256 = _V["sha256"]
            if not _none_hash_ready:
                _V["init_none_hash"](sha256)  # once per process, as EngineCore does
                _none_hash_ready = True
            self._hasher = _V["get_request_block_hasher"](block_size, sha256)
        self._sampling = _V["SamplingParams"](max_tokens=1 << 30)
        self._reqs: dict[int, Any] = {}
        self._seqs = self._reqs  # what the base class introspects
        self._key: Any = None
        self._batch: list[Any] = []
        self._n_new: list[int] = []
        self._rows: list[Any] = []
        self._prepared = False
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._allocations = 0

    # -- admission ------------------------------------------------------------------------------------
    def _request(self, seq_id: int, token_ids: Seq[int]) -> Any:
        tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else [int(t) for t in token_ids]
        return Request(str(seq_id), tokens, self._sampling, None, block_hasher=self._hasher)

    def can_allocate(self, token_ids: Seq[int], num_lookahead_slots: int = 0, *, namespace: object = None) -> AllocStatus:
        """Block count only (prefix hits ignored, so LATER may be pessimistic); V1 itself has no such call."""
        self._no_namespace(namespace)
        need = _cdiv(len(token_ids) + num_lookahead_slots, self.block_size)
        wm = self.km.watermark_blocks
        if self.num_gpu_blocks - need < wm:
            return AllocStatus.NEVER
        free = self.km.block_pool.get_num_free_blocks()
        if free - need < (wm if self._reqs else 0):
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, seq_id: int, token_ids: Seq[int], *, namespace: object = None) -> int:
        self._no_namespace(namespace)
        if seq_id in self._reqs:
            raise ValueError(f"sequence {seq_id} already allocated")
        return self.admit(seq_id, self._request(seq_id, token_ids))

    def make_request(self, seq_id: int, token_ids: Seq[int]) -> Any:
        """The engine-side ``Request`` of a prompt (with prefix caching its block hashes are computed here, as
        V1's engine core does when a request arrives), for :meth:`admit`."""
        return self._request(seq_id, token_ids)

    def admit(self, seq_id: int, req: Any) -> int:
        """The scheduler's admission calls for a request made by :meth:`make_request` (what :meth:`allocate`
        times after building the request); returns the prefix-hit token count."""
        if seq_id in self._reqs:
            raise ValueError(f"sequence {seq_id} already allocated")
        km = self.km
        blocks, num_hit, _ = km.get_computed_blocks(req)
        new = km.allocate_slots(
            req,
            req.num_tokens - num_hit,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=blocks,
            full_sequence_must_fit=True,
            has_scheduled_reqs=bool(self._reqs),
        )
        if new is None:
            raise AnchorOutOfBlocks(f"{self.name}: no room for a {req.num_tokens}-token prompt")
        km.get_blocks(req.request_id)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens  # _update_after_schedule of the prefill step
        self._reqs[seq_id] = req
        self._prompt_tokens += req.num_tokens
        self._hit_tokens += num_hit
        self._allocations += 1
        return num_hit

    # -- decode ---------------------------------------------------------------------------------------
    def can_append_slots(self, seq_ids: Seq[int], num_lookahead_slots: int = 0, *, num_new_tokens: int = 1) -> bool:
        """Whether every request can get its new token(s) plus the lookahead (block count summed over groups).

        Before ``prepare_step`` ``num_new_tokens`` per request are assumed, as in pagedkv.  With a sliding
        window the count ignores the blocks V1 would release first, so it errs on the safe side.
        """
        bs = self.block_size
        need = 0
        extra = 0 if self._prepared else num_new_tokens
        for sid in seq_ids:
            req = self._reqs[sid]
            want = _cdiv(req.num_tokens + extra + num_lookahead_slots, bs)
            for ids in self.km.get_block_ids(req.request_id):  # one list per group (V1 pads with null blocks)
                need += max(0, want - len(ids))
        return need <= self.km.block_pool.get_num_free_blocks()

    def prepare_step(self, seq_ids: Seq[int], token_ids: Any) -> None:
        """Untimed: what V1's engine does around the forward (see the module docstring):
        :meth:`stage` then :meth:`update_requests`."""
        self.stage(seq_ids, token_ids)
        self.update_requests()

    def stage(self, seq_ids: Seq[int], token_ids: Any) -> None:
        """The adapter's own bookkeeping for the next step (tokens as lists, the batch's requests looked up);
        no V1 work. :meth:`update_requests` then :meth:`decode_step` must follow."""
        rows = token_rows(token_ids)
        if len(rows) != len(seq_ids):
            raise ValueError("seq_ids and token_ids differ in length")
        batch = []
        for sid in seq_ids:
            req = self._reqs[sid]
            if req.status != RequestStatus.RUNNING:
                raise ValueError(f"sequence {sid} is not running")
            batch.append(req)
        self._batch = batch
        self._key = seq_ids
        self._rows = [row[0] if len(row) == 1 else row for row in rows]
        self._n_new = [len(row) for row in rows]  # ragged with speculative decoding: accepted tokens + 1

    def update_requests(self) -> None:
        """V1's engine work on the staged batch's requests: ``num_computed_tokens`` advanced over the tokens of
        the previous step (``_update_after_schedule``) and the sampled tokens appended
        (``Request.append_output_token_ids``, in ``update_from_output``), which with prefix caching hashes
        every block that has just become full (the request's block hasher). O(B) plus O(1) per filled block."""
        for req, tok in zip(self._batch, self._rows):
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(tok)
        self._prepared = True  # the tokens are in: can_append_slots counts no extra one

    def decode_step(self, seq_ids: Seq[int], token_ids: Any = None, num_lookahead_slots: int = 0, *,
                    num_new_tokens: Any = None) -> AnchorStep:
        """Timed: the KV-cache-manager calls of V1's scheduler for one decode step of the batch."""
        reqs = self._batch if seq_ids is self._key else [self._reqs[s] for s in seq_ids]
        km = self.km
        allocate_slots = km.allocate_slots
        km.new_step_starts()
        new_ids: list[Any] = []
        for req, n in zip(reqs, self._n_new):
            blocks = allocate_slots(req, n, num_lookahead_tokens=num_lookahead_slots)
            if blocks is None:
                self._prepared = False
                raise AnchorOutOfBlocks(f"{self.name}: no room to append for request {req.request_id}")
            new_ids.append(blocks.get_block_ids(allow_none=True))
        km.take_boundary_state_offloads()
        copies, _retained = km.take_kv_cache_block_copies()
        km.take_new_block_ids()
        km.take_events()
        self._prepared = False
        cow = [(c.src_block_id, c.dst_block_id) for c in copies] if copies else []
        return AnchorStep(new_ids, cow)

    def free(self, seq_id: int, *, cache: bool = True) -> None:
        req = self._reqs.pop(seq_id)
        req.status = RequestStatus.FINISHED_STOPPED
        self.km.free(req)

    # -- introspection ----------------------------------------------------------------------------------
    @property
    def num_free_gpu_blocks(self) -> int:
        return self.km.block_pool.get_num_free_blocks()

    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """Group ``group``'s block ids of the request (V1's null block 0 where a sliding group released one)."""
        return list(self.km.get_block_ids(self._reqs[seq_id].request_id)[group])

    def settle(self, seq_id: int) -> None:
        """Release the blocks a sliding group no longer needs after admission, as the request's next
        ``allocate_slots`` would first do (``KVCacheManager.remove_skipped_blocks``, the call V1's scheduler
        makes; see the module docstring). A no-op for full-attention groups."""
        req = self._reqs[seq_id]
        self.km.remove_skipped_blocks(req.request_id, req.num_computed_tokens,
                                      num_prompt_tokens=req.num_prompt_tokens)

    def num_tokens(self, seq_id: int) -> int:
        return self._reqs[seq_id].num_tokens

