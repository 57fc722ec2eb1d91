"""``pagedkv router``: a KV-cache-aware router in front of several ``pagedkv serve`` replicas.

Modules: :mod:`.prompt` (the request's token ids exactly as the engine builds them, and their block hashes),
:mod:`.events` (ZMQ subscription to every replica's KV events: sequence numbers, gaps, replays, restarts, malformed
messages, index outages), :mod:`.state` (replicas, health, loads, the index and the policy: one routing
decision), :mod:`.proxy` (one request to a replica and back: retries, timeouts, error events, aborts),
:mod:`.health` (health checks), :mod:`.metrics`, :mod:`.app` (the OpenAI-compatible routes) and :mod:`.cli`.
Imports FastAPI, httpx, pyzmq (extra ``pagedkv[router]``), never torch; the torch-free index and policies live in
:mod:`pagedkv.cluster`. Faults and what the router does about them: docs/router-reliability.md.
"""
