"""Health checks of the replicas (and of a stale index when no event subscriber probes it).

One thread polls ``GET /health`` of every replica every ``interval`` seconds over kept-alive connections (so a
check is one short request, not a new connection each time; replicas leave these requests out of their access
log). A replica that fails ``fails`` checks in a row (no answer within ``timeout`` seconds, or not 200) leaves
routing and the index; one that answers 200 comes back. Each change is one log line (:meth:`RouterState.mark`).
Each round also pings the index (an outage shows in ``/health`` within a round even when no request or event
touches it) and, when no event subscriber does it, notices when the index is back.
The first time a replica answers 200, the checker also asks its ``GET /v1/models`` (with the replica API key)
when the router was given its model's names: a replica serving none of them gets one WARNING line (the router
tokenizes for another model, so its prefix hashes never match that replica's cache and clients naming the
router's model get 404 there); ``model_mismatch`` maps such a replica's URL to the ids it serves.
A busy replica on a saturated CPU can take a second to answer: the defaults (3 checks of 3 s) keep it in. The
thread never ends on an error (it is logged, at most once a minute per kind).
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["HealthChecker"]

log = logging.getLogger("pagedkv.router")


class HealthChecker:
    def __init__(self, state, interval: float = 1.0, timeout: float = 3.0, fails: int = 3, *,
                 model_names: tuple[str, ...] = (), api_key: str | None = None) -> None:
        self.state, self.interval, self.timeout, self.fails = state, interval, timeout, fails
        self.model_names, self.api_key = tuple(model_names), api_key
        #: replica URL -> the model ids it serves, for the replicas that serve none of ``model_names``
        self.model_mismatch: dict[str, tuple[str, ...]] = {}
        self._models_checked: set[str] = set()
        self.errors = 0
        self._client = None
        self._last_log = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-router-health", daemon=True)

    def start(self) -> "HealthChecker":
        self._thread.start()
        return self

    def _get(self, url: str):
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout, limits=httpx.Limits(max_keepalive_connections=64))
        return self._client.get(url + "/health")

    def check_once(self) -> None:
        import httpx

        st = self.state
        for url, r in list(st.replicas.items()):
            try:
                code = self._get(url).status_code
                reason = f"/health answered {code}"
            except httpx.HTTPError as e:
                code, reason = None, f"/health failed: {type(e).__name__}"
            if code == 200:
                st.mark(url, True)
                if self.model_names and url not in self._models_checked:
                    self._check_models(url)
            elif r.failures + 1 >= self.fails or not r.healthy:
                st.mark(url, False, f"{reason}, {self.fails} checks in a row" if r.healthy else reason)
            else:
                r.failures += 1
        if st.index_ok:  # an idle router learns of an index outage here, not from its next request
            if not st.probe_index():
                from ..cluster.index import IndexUnavailableError

                st.index_failed(IndexUnavailableError("the index does not answer PING"))
        elif st.subscriber is None and st.probe_index():
            st.index_recovered()  # nothing to rebuild it from (events are off): route with it again

    def _check_models(self, url: str) -> None:
        """Once per replica: warn when its ``/v1/models`` lists none of ``model_names`` (not retried once it
        answered; a replica that cannot answer, e.g. 401 without the replica key, is not checked)."""
        import httpx

        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = self._client.get(url + "/v1/models", headers=headers)
            if r.status_code != 200:
                self._models_checked.add(url)
                return
            ids = tuple(str(m.get("id")) for m in r.json().get("data", ()) if isinstance(m, dict))
        except (httpx.HTTPError, ValueError, AttributeError):
            return  # tried again on the next round
        self._models_checked.add(url)
        if not set(ids) & set(self.model_names):
            self.model_mismatch[url] = ids
            log.warning("replica %s serves %s, but this router tokenizes for %s (--model): its prefix hashes "
                        "will not match that replica's cache, and requests naming %r get 404 there", url,
                        ", ".join(ids) or "no model", " / ".join(self.model_names), self.model_names[0])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check_once()
            except Exception as e:  # never let the checks stop
                self.errors += 1
                now = time.monotonic()
                if now - self._last_log.get(type(e), -1e18) > 60:
                    self._last_log[type(e)] = now
                    log.exception("health checks: unexpected %s (checks go on)", type(e).__name__)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._client is not None:
            self._client.close()
