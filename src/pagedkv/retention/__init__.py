"""Retention: which cached blocks stay when blocks are needed.

::

    eviction   the eviction policies (lru, slru, session), one small class each, make_evictor
    steering   request priorities and pinned prefixes over a policy (SteeredEvictor, Pin)
"""
