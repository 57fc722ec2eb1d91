"""The prefill replica's routes of a prefill/decode split, under their former home: see
:mod:`pagedkv.server.routes.kv`."""

from .routes.kv import add_kv_routes

__all__ = ["add_kv_routes"]
