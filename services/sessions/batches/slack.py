"""How many lines of a model a batch's owner may release now: room in its tenant's batch queue.

A batch line's job waits in its tenant's batch queue of the model (with the fair share off, the
model's batch queue: `shared/topology.py`) until a worker has a sequence nothing else wants and
the fair share picks the tenant; the workers take from it themselves
(`services/worker/pulling.py`). So the owners only keep that queue stocked: a tenant's lines of a
model are released while fewer than `AXON_BATCH_QUEUE_AHEAD` wait in it, enough for every free
sequence to find one at once, few enough that a cancel or a window's end has little to call back.
RabbitMQ reports a queue's ready messages in the answer to a passive declare, the queue-depth
poller's way (`queue_depth.py`); an answer is reused for `FRESH_S`, less the lines released
since, so the batches one process owns share one question per queue.
"""

import contextlib
import time

from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection
from aiormq.exceptions import ChannelNotFoundEntity

from shared.logging import get_logger
from shared.names import Names

log = get_logger(__name__)

FRESH_S = 0.5
_DECLARE_TIMEOUT_S = 5.0


class QueueSlack:
    """Counts the room left in a model's batch queue (see the module's docstring)."""

    def __init__(self, connection: AbstractRobustConnection, names: Names, *, ahead: int, fair: bool) -> None:
        self._connection = connection
        self._names = names
        self._ahead = ahead
        # Whether lines wait in their tenant's batch queue (the fair share on), or the model's.
        self._fair = fair
        self._channel: AbstractRobustChannel | None = None
        # Per queue: when it was asked, and the room left since.
        self._answers: dict[str, tuple[float, int]] = {}

    async def take(self, model: str, tenant: str) -> bool:
        """Whether one more line of `model` of `tenant` may be released now; if so, it is counted
        as waiting (a queue not declared yet: empty; the broker unreachable: no room)."""
        queue = self._names.tenant_queue(model, tenant, batch=True) if self._fair else self._names.batch_queue(model)
        now = time.monotonic()
        answer = self._answers.get(queue)
        if answer is None or now - answer[0] > FRESH_S:
            answer = (now, await self._room(queue, model))
        if answer[1] <= 0:
            self._answers[queue] = answer
            return False
        self._answers[queue] = (answer[0], answer[1] - 1)
        return True

    async def _room(self, name: str, model: str) -> int:
        try:
            if self._channel is None or self._channel.is_closed:
                self._channel = await self._connection.channel()
            # robust=False: a robust channel caches passively declared queues, with their counts.
            queue = await self._channel.declare_queue(name, passive=True, robust=False, timeout=_DECLARE_TIMEOUT_S)
        except ChannelNotFoundEntity:
            await self._drop_channel()  # the broker closed it
            return self._ahead
        except Exception as exc:  # noqa: BLE001 - no answer: no line is released until there is one
            log.warning("batch_slack_unknown", model=model, error=repr(exc))
            await self._drop_channel()
            return 0
        return self._ahead - (queue.declaration_result.message_count or 0)

    async def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await channel.close()
