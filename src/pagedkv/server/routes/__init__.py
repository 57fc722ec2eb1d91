"""The routes of ``pagedkv serve``, one module per job, each a FastAPI ``APIRouter`` that reaches the server's
shared state through :func:`.state.server_state` (``app.state.server``):

* :mod:`.openai`: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, and a request's way through the
  engine (tokenize, check, queue, answer whole or streamed);
* :mod:`.pins`: ``/v1/pins`` (pinned prefixes; :mod:`.retention`);
* :mod:`.tokenize`: vLLM's ``/tokenize`` and ``/detokenize``;
* :mod:`.kv`: the prefill replica's ``/v1/kv/holds/{id}``;
* :mod:`.admin`: ``/health`` and ``/metrics``;
* :mod:`.errors`: every error in OpenAI's shape.

:func:`pagedkv.server.app.build_app` assembles them.
"""
