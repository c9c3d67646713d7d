"""Whether a model has slack for batch lines: no job waits in its queue.

A worker takes jobs up to its engine's free sequences (its prefetch is its most concurrent
sequences), so a model whose queue holds a ready job has no free sequence anywhere: interactive
work is waiting, or lines released before. A batch's owner releases lines of a model only while
its queue is empty (`service.py`), so at most one round of lines waits at a time, behind any
interactive job (they have a higher priority). RabbitMQ reports a queue's ready messages in the
answer to a passive declare, the queue-depth poller's way (`queue_depth.py`); answers are reused
for `FRESH_S`, so the batches one process owns share one question per model.
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
    """Asks RabbitMQ whether a model's queue is empty (see the module's docstring)."""

    def __init__(self, connection: AbstractRobustConnection, names: Names) -> None:
        self._connection = connection
        self._names = names
        self._channel: AbstractRobustChannel | None = None
        self._answers: dict[str, tuple[float, bool]] = {}

    async def has_slack(self, model: str) -> bool:
        """Whether no job of `model` waits in its queue (a queue not declared yet: none waits; the
        broker unreachable: no slack)."""
        now = time.monotonic()
        answer = self._answers.get(model)
        if answer is None or now - answer[0] > FRESH_S:
            answer = (now, await self._ask(model))
            self._answers[model] = answer
        return answer[1]

    async def _ask(self, model: str) -> bool:
        try:
            if self._channel is None or self._channel.is_closed:
                self._channel = await self._connection.channel()
            # robust=False: a robust channel caches passively declared queues, with their counts.
            queue = await self._channel.declare_queue(
                self._names.jobs_queue(model), passive=True, robust=False, timeout=_DECLARE_TIMEOUT_S
            )
        except ChannelNotFoundEntity:
            await self._drop_channel()  # the broker closed it
            return True
        except Exception as exc:  # noqa: BLE001 - no answer: no line is released until there is one
            log.warning("batch_slack_unknown", model=model, error=repr(exc))
            await self._drop_channel()
            return False
        return not queue.declaration_result.message_count

    async def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await channel.close()
