"""Retention: which cached blocks stay when blocks are needed.

::

    eviction   the eviction policies (lru, slru, session, density, arc), one small class each, make_evictor
    density    the density policy: least hit density first, learnt online (DensityEvictor, HitDensity)
    arc        the arc policy: adaptive replacement with ghost lists of content keys (ARCEvictor)
    _logs      a push log with lazy deletion (the session and density policies' orders)
    steering   request priorities and pinned prefixes over a policy (SteeredEvictor, Pin)
"""
