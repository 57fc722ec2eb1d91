"""``pagedkv serve``: an OpenAI-compatible HTTP server over the reference engine (extra ``pagedkv[serve]``).

Modules, each with one job (dependencies point one way: app -> async_engine -> engine -> scheduler -> manager):

* :mod:`~pagedkv.server.validation`: a request body's validation at the edge (content type, body size, JSON, each
  field's type and range, OpenAI's messages); a plain module the router shares. The 400s it raises are built by
  :mod:`~pagedkv.server.api_error`.
* :mod:`~pagedkv.server.http_guard`: the HTTP connection's deadlines and cap (uvicorn's h11 protocol, guarded).
* :mod:`~pagedkv.server.async_engine`: the engine's step loop in one background thread; per-request streams,
  aborts between steps, a bounded waiting queue, counters for the metrics.
* :mod:`~pagedkv.server.metrics`: the Prometheus registry (``pagedkv:`` names, vLLM style).
* :mod:`~pagedkv.server.kv_events`: KV-cache events over ZMQ in vLLM's wire layout, with a replay socket.
* :mod:`~pagedkv.server.tokenization`: vLLM's ``/tokenize`` and ``/detokenize`` bodies and answers (plain, as
  :mod:`~pagedkv.server.validation`; the router shares it).
* :mod:`~pagedkv.server.routes`: the FastAPI routes, one ``APIRouter`` module per job (OpenAI's routes and their
  response shapes, pins, tokenizer routes, the KV handoff's holds, health and metrics) over one shared state
  object.
* :mod:`~pagedkv.server.app`: ``build_app``, the assembly of those routes.
* :mod:`~pagedkv.server.launch`: wires an ``LLM`` into the above and runs it (foreground, or a thread for tests).
* :mod:`~pagedkv.server.cli`: ``pagedkv serve``; :mod:`~pagedkv.server.bench`: ``pagedkv bench serve``.

Nothing here is imported by the core or by ``pagedkv.cli`` at import time.
"""
