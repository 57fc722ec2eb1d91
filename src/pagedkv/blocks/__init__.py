"""The per-block leaves: state in flat arrays indexed by block id, no object per block.

::

    pool             BlockPool: refcounts and the free ring of one pool (GPU or CPU); Blocks: taking and releasing
                     blocks over the pools and the evictor
    prefix_cache     chained content keys, the cache map key -> block: what a request calls
    cache_periphery  the prefix cache's cold parts (its base class): KV events, copies, swap-in adoption, reset
    policy           EvictionPolicy, the base class of the eviction policies (segments of push logs), POLICIES
    evictor          the eviction order of unreferenced cached blocks (LRU; RetentionEvictor)

Nothing here knows about sequences; :mod:`pagedkv.manager` does.
"""
