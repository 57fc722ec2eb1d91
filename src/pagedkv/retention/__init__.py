"""Retention: which cached blocks stay when blocks are needed.

::

    eviction   the eviction policies (lru, slru, session, density, arc), one small subclass each of
               pagedkv.blocks.policy.EvictionPolicy, the table POLICIES by name, make_evictor
    density    the density policy: least hit density first, learnt online (DensityEvictor, HitDensity)
    arc        the arc policy: adaptive replacement with ghost lists of content keys (ARCEvictor)
    steering   request priorities and pinned prefixes over a policy (SteeredEvictor, Pin)
"""
