"""``pagedkv router``: a KV-cache-aware router in front of several ``pagedkv serve`` replicas.

Modules: :mod:`.prompt` (the request's token ids exactly as the engine builds them, and their block hashes),
:mod:`.events` (ZMQ subscription to every replica's KV events: sequence numbers, gaps, replays, restarts),
:mod:`.state` (replicas, health, loads, the index and the policy: one routing decision), :mod:`.metrics`,
:mod:`.app` (the OpenAI-compatible proxy) and :mod:`.cli`. Imports FastAPI, httpx, pyzmq (extra
``pagedkv[router]``); the torch-free index and policies live in :mod:`pagedkv.cluster`.
"""
