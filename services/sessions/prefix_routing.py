"""Routing on the prefix index (`shared/prefix_index.py`): the worker whose KV cache holds the longest
prefix of a request's prompt, weighed against its load (`shared/affinity.py:prefix_route`).

Per request: the prompt's anchors (a hash per 256 characters, no tokenizer), then one pipelined
round trip to Redis (an SMISMEMBER per live indexed worker of the model), bounded by
`AXON_PREFIX_LOOKUP_TIMEOUT_MS`. Read only for a single-choice job whose prompt is long enough
(`shared/prefix_index.py:routed`; a shorter one costs nothing here, nor at the worker) and a model
with indexed workers. Anything the index cannot answer
(Redis away or slow) leaves the request to today's rules, said once per outage.

Load is this session manager's own count of the jobs it sent to each worker's queue and that have
not ended: exact for its own bursts (16 requests for one hot document arriving together see each
other), blind to other replicas' (each spreads its own share).
"""

import asyncio
from collections import Counter as Tally

from prometheus_client import Counter

from shared.affinity import Route, prefix_route
from shared.logging import get_logger
from shared.outages import Outage
from shared.prefix_index import PrefixIndex, anchors, routed
from shared.registry import LiveModel
from shared.schemas import Job

log = get_logger(__name__)


class PrefixRouter:
    """Picks a job's home from the prefix index and keeps this session manager's load per worker."""

    def __init__(
        self, index: PrefixIndex, *, spill_seqs: int, lookup_timeout_s: float, routes: Counter | None = None
    ) -> None:
        self._index = index
        self._spill_seqs = spill_seqs
        self._timeout_s = lookup_timeout_s
        self._routes = routes
        self._loads: Tally[str] = Tally()
        self._outage = Outage("prefix_index", first_s=0.5, cap_s=0.5)

    async def route(self, job: Job, live: LiveModel, *, session_home: str | None) -> Route | None:
        """Where `job` goes first by the index (None: today's rules, `shared/affinity.py:job_home`)."""
        workers = live.indexed & live.homes
        if not workers:
            return None
        if not routed(job.messages, job.prompt):
            return None
        found = anchors(messages=job.messages, prompt=job.prompt, tools=job.tools, adapter=job.adapter)
        if not found:
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                matches = await self._index.matches(job.model, [a.key for a in found], workers)
        except Exception as exc:  # noqa: BLE001 - Redis away or slow: today's rules
            self._outage.failed(exc, fallback="session affinity only")
            return None
        self._outage.recovered()
        return prefix_route(matches=matches, loads=self._loads, session_home=session_home, spill_seqs=self._spill_seqs)

    def count(self, model: str, route: Route | None, *, home: str | None) -> None:
        """Count a routing decision (`axon_sessions_prefix_routes_total`): the index's, else
        today's rules' (`home`: the session's home they chose, None: the shared queue)."""
        if self._routes is None:
            return
        reason = route.reason if route is not None else "session" if home is not None else "none"
        self._routes.labels(model, reason).inc()

    def started(self, worker: str) -> None:
        """A job was sent to `worker`'s queue."""
        self._loads[worker] += 1

    def ended(self, worker: str) -> None:
        """A job sent to `worker`'s queue ended (answered, failed or given up)."""
        self._loads[worker] -= 1
        if self._loads[worker] <= 0:
            del self._loads[worker]
